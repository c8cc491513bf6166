"""int4pack stores and the machine they were packed on.

An int4pack store holds each matrix in torch's CPU int4 kernel layout (quant/kernel.py), written at conversion
from a GGUF file's own 4-bit codes (quant/ggml.py DIRECT) or from quant/int4.quantize_asym at bf16. That layout
depends on the CPU capability torch dispatches to, so the store records the layout it was packed for
(`layout_tag`, manifest extra "int4pack_layout") and a reader checks it before multiplying anything.
"""
from __future__ import annotations

from ..quant.kernel import layout_tag  # noqa: F401 (what a store records; convert and selfdraft write it)


def check_store_layout(manifest) -> None:
    """An int4pack store's bytes are only right for the kernel layout they were packed for (it depends on the CPU
    capability torch dispatches to): refuse a store packed for another one rather than multiply garbage."""
    from ..errors import StoreError

    if manifest.dtype != "int4pack":
        return
    theirs, ours = manifest.extra.get("int4pack_layout"), layout_tag()
    if theirs != ours:
        raise StoreError(f"this int4pack store was packed for the int4 kernel layout {theirs}, but torch here uses "
                         f"{ours} (another CPU type): convert the model again on this machine")
