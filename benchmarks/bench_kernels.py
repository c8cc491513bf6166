"""What one layer of the 1.5B target costs on this CPU, by matmul kernel, for the rows a sweep carries.

    python benchmarks/bench_kernels.py                # Qwen2.5-1.5B's shapes, 1 and 2 threads, 1-16 rows
    python benchmarks/bench_kernels.py --json out.json

The sweep's compute sets the upper edge of where streaming wins (issue 49): with the model in memory, llama.cpp
decodes a token of the 1.5B in ~30-45 ms on 2 cores, where a 10-row sweep of ours computed for ~430-550 ms. The
kernels timed, on random weights of one decoder layer's shapes (q/k/v fused, o, gate/up fused, down; the head
apart):

- int4pack: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, group 32), bf16 activations, as the int4pack
  store ran until q4q8, and with fp32 activations (its slow path, for reference);
- int4pack, q4q8: the same packed bytes through quant/q4q8.py (4-bit weights x activations quantized to int8 per
  group of 32, AVX512-VNNI; what the engine runs where it is available), quantizing included;
- int8 dynamic: fbgemm's dynamically quantized linear (`quantized.linear_dynamic`, the "x86" engine), int8
  per-channel weights, activations quantized to 8 bits per call (reduce_range: 7 bits, no int16 saturation);
- int8 int_mm: `torch._int_mm` (int8 x int8 -> int32), int8 per-channel weights, each activation row quantized to
  int8 with its own scale (quantizing included): integer sums are exact, so a row's result cannot depend on the
  other rows of the batch, which fbgemm's per-tensor activation scale breaks (`--check` tests it: each row of a
  16-row call against the row alone);
- fp32: the same layer dense in fp32 (MKL), the engine's fp32 stores.

It prints ms per layer and projects (labelled) a 28-layer sweep without the head: a projection from one layer's
median, not a measured sweep. Apart from q4q8, nothing here is used by the engine: it is the evidence for choosing
its kernels.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from streamspec_ray.quant import q4q8

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 query heads and 2 KV heads of 128
SHAPES = {"qkv": (1536, 1536 + 2 * 256), "o": (1536, 1536), "gate_up": (1536, 2 * 8960), "down": (8960, 1536)}
LAYERS = 28


def timed(fn, repeats: int) -> float:
    fn()  # (warm: first-call allocations and packing)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_kernels(rows: int) -> dict:
    """kernel -> a function running one layer's four matmuls on `rows` rows."""
    g = torch.Generator().manual_seed(0)
    out = {}
    xs = {k: torch.randn(rows, i, generator=g) for k, (i, _) in SHAPES.items()}
    packed, dyn, dense = {}, {}, {}
    torch.backends.quantized.engine = "x86"
    for k, (i, o) in SHAPES.items():
        q = torch.randint(0, 16, (o, i), dtype=torch.int32, generator=g)
        packed[k] = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                     torch.randn(i // 32, o, 2, generator=g) * 0.01)
        w = torch.randn(o, i, generator=g) * 0.02
        dense[k] = w.t().contiguous()
        qw = torch.quantize_per_channel(w, w.abs().amax(1) / 127 + 1e-8, torch.zeros(o, dtype=torch.long), 0,
                                        torch.qint8)
        dyn[k] = torch.ops.quantized.linear_prepack(qw, None)
    xb = {k: x.bfloat16() for k, x in xs.items()}
    sb = {k: (p, s.bfloat16()) for k, (p, s) in packed.items()}
    out["int4pack, bf16 activations"] = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], p, 32, s)
                                                 for k, (p, s) in sb.items()]
    out["int4pack, fp32 activations"] = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], p, 32, s)
                                                 for k, (p, s) in packed.items()]
    if q4q8.available():
        out["int4pack, q4q8"] = lambda: [q4q8.mm(xs[k], p, s, 32) for k, (p, s) in sb.items()]
    out["int8 dynamic (fbgemm)"] = lambda: [torch.ops.quantized.linear_dynamic(xs[k], p, True)
                                            for k, p in dyn.items()]
    ints = {k: int8_weight(w.t()) for k, w in dense.items()}
    out["int8 int_mm, per-row"] = lambda: [int8_rows_mm(xs[k], *iw) for k, iw in ints.items()]
    out["fp32 dense (MKL)"] = lambda: [xs[k] @ w for k, w in dense.items()]
    return out


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] fp32 -> (int8 codes as an [in, out] view of [out, in] storage, per-output-channel scales)."""
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).t(), scale


def int8_rows_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32 times int8 weights, each row of x quantized to int8 with its own scale."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
    xq = (x / s).round().clamp(-127, 127).to(torch.int8)
    return torch._int_mm(xq, codes).float() * s * scale


def batch_invariant(rows: int = 16) -> bool:
    """Whether int8_rows_mm gives each row of a `rows`-row call exactly what the row alone gives."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 1536, generator=g)
    codes, scale = int8_weight(torch.randn(2 * 8960, 1536, generator=g) * 0.02)
    whole = int8_rows_mm(x, codes, scale)
    return all(torch.equal(whole[i : i + 1], int8_rows_mm(x[i : i + 1], codes, scale)) for i in range(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,10,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    p.add_argument("--check", action="store_true", help="only test int8 int_mm's batch invariance")
    a = p.parse_args()
    if a.check:
        for threads in map(int, a.threads.split(",")):
            torch.set_num_threads(threads)
            print(f"{threads} thread(s): int8 int_mm, per-row activations, batch-invariant: {batch_invariant()}")
        return
    records = []
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in map(int, a.rows.split(",")):
            for name, fn in layer_kernels(rows).items():
                reps = a.repeats if "fp32 activations" not in name else max(1, a.repeats // 3)
                s = timed(fn, reps)
                records.append({"kernel": name, "threads": threads, "rows": rows, "layer_ms": s * 1e3,
                                "projected_sweep_ms": s * 1e3 * LAYERS})
                print(f"{threads} thread(s), {rows:>2} rows, {name:<28} {s * 1e3:8.2f} ms a layer; projected "
                      f"{s * 1e3 * LAYERS:7.0f} ms for {LAYERS} layers", flush=True)
    print("\n| threads | rows | " + " | ".join(dict.fromkeys(r["kernel"] for r in records)) + " |")
    print("|---|---|" + "---|" * len(dict.fromkeys(r["kernel"] for r in records)))
    for (t, n) in dict.fromkeys((r["threads"], r["rows"]) for r in records):
        cells = [f"{r['layer_ms']:.2f}" for r in records if (r["threads"], r["rows"]) == (t, n)]
        print(f"| {t} | {n} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
