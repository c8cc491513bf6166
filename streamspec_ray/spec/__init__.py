"""The old name of streamspec_ray.speculative, kept so that code written against it still imports:
`from streamspec_ray.spec.rejection import verify_chain` gives the same function as speculative.rejection."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_OLD, _NEW = __name__, __name__.rsplit(".", 1)[0] + ".speculative"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """streamspec_ray.spec.X is the module streamspec_ray.speculative.X itself (one module, two names)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith(_OLD + "."):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(_NEW + spec.name[len(_OLD):])

    def exec_module(self, module) -> None:
        # already executed under its own name; the import system has just set its __spec__ to this alias's
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)
        module.__loader__ = module.__spec__.loader


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
