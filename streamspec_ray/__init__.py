"""streamspec-ray: run language models larger than accelerator memory by streaming the target's layers once
per speculative round."""
from .engine import Engine, GenerationResult
from .errors import StreamspecError

__all__ = ["Engine", "GenerationResult", "RayEngine", "StreamspecError"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "RayEngine":  # imported lazily: `import ray` costs seconds
        from .actors.engine import RayEngine
        return RayEngine
    raise AttributeError(name)
