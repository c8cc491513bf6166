"""Every weight format, once: quantizers, block decoders, packed layouts, and the weight type models multiply by.

  int4.py    the asymmetric int4 quantizer (quantize_asym: fp16 or bf16 scales) and the `int4` store's layout
             (nibble pairs, fp16 scales: quantize_int4, quantize_int4_asym, dequantize_int4)
  ggml.py    GGUF blocks (Q4_0 ... Q6_K) dequantized in torch as gguf-py does, and 4-bit blocks read as int4 codes
  kernel.py  torch's CPU int4 kernel: its packed code layout (pack, unpack_codes, kernel_layout) and matmul
  packed.py  what models see: `linear(x, w)`, PackedInt4 (a weight that stays 4-bit and multiplies through the
             kernel), joining and copying weights, float weights -> resident 4-bit ones
  int8.py    PackedInt8: a held weight on fbgemm's int8 GEMM, each activation row quantized alone (an opt-in for
             targets held whole: runtime/executor.py StreamingExecutor._int8)

Plain torch / numpy: nothing here imports the models, the runtime or the store.
"""
from .int4 import (GROUP_SIZE, can_quantize, dequantize_int4, quant_report, quantize_asym, quantize_int4,
                   quantize_int4_asym)
from .packed import PackedInt4, join_rows, linear, owned, row_invariant, split_rows

__all__ = ["GROUP_SIZE", "PackedInt4", "can_quantize", "dequantize_int4", "join_rows", "linear", "owned",
           "quant_report", "quantize_asym", "quantize_int4", "quantize_int4_asym", "row_invariant", "split_rows"]
