"""Bytes read per streamed sweep on a MoE store: the union of routed experts vs every expert, by chunk size.

Builds a tiny-but-not-trivial random DeepSeek-V3 model with transformers (64 routed experts, top-6, 8 groups of
which 4 are kept, one shared expert, first layer dense), converts it to an fp32 store, then runs sweeps of
1, 4, 8 and 16 tokens after a prefill and reports what the executor measured: experts read per sweep, expert
bytes read vs all experts' bytes, and whole-sweep bytes vs a sweep that read every expert. Also the MLA
cache's bytes per token against a full per-head K/V cache.

    python benchmarks/bench_moe.py [--sweeps 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.store.convert import convert

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=8, n_routed_experts=64, num_experts_per_tok=6, n_group=8,
              topk_group=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
              qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def build(folder: str, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **CONFIG), dtype=torch.float32)
    with torch.no_grad():  # the default init (std 0.02) routes almost uniformly at random; keep it, add a bias
        for name, b in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.02)
    model.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", type=int, default=8, help="sweeps measured per chunk size")
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(f"{tmp}/hf", opts.seed)
        convert(f"{tmp}/hf", f"{tmp}/store", dtype="fp32")
        ex = StreamingExecutor(f"{tmp}/store")
        a = ex.args
        gen = torch.Generator().manual_seed(opts.seed)
        dense = sum(ex.store.manifest.unit(n).bytes for n in ex.layer_names + ["head"])
        moe_layers = sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
        print(f"DeepSeek-V3 random: {a.num_hidden_layers} layers ({moe_layers} MoE), {a.n_routed_experts} experts "
              f"top-{a.num_experts_per_tok}, groups {a.n_group} keep {a.topk_group}; expert shard "
              f"{ex.expert_bytes_all // ex.experts_total} B, all experts {ex.expert_bytes_all / 1e6:.2f} MB, "
              f"layers+head {dense / 1e6:.2f} MB per sweep")
        print(f"{'chunk':>5} {'experts read/sweep':>19} {'of':>4} {'expert MB':>10} {'all-expert MB':>14} "
              f"{'expert frac':>11} {'sweep MB':>9} {'sweep MB (all)':>15} {'saved':>6}")
        for T in (1, 4, 8, 16):
            cache = ex.new_cache()
            ex.sweep(torch.randint(0, a.vocab_size, (32,), generator=gen).tolist(), cache)  # prefill
            rows = []
            for _ in range(opts.sweeps):
                _, st = ex.sweep(torch.randint(0, a.vocab_size, (T,), generator=gen).tolist(), cache)
                rows.append(st)
            er = statistics.mean(s.experts_read for s in rows)
            eb = statistics.mean(s.expert_bytes for s in rows)
            sb = statistics.mean(s.bytes_read for s in rows)
            full = sb - eb + rows[0].expert_bytes_all
            print(f"{T:>5} {er:>19.1f} {rows[0].experts_total:>4} {eb / 1e6:>10.3f} "
                  f"{rows[0].expert_bytes_all / 1e6:>14.3f} {eb / rows[0].expert_bytes_all:>11.3f} "
                  f"{sb / 1e6:>9.3f} {full / 1e6:>15.3f} {1 - sb / full:>6.1%}")
        cache = ex.new_cache()
        ex.sweep([1, 2, 3], cache)
        ex.close()
        latent = cache.bytes_per_token()
        full_kv = a.num_hidden_layers * a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim
                                                                 + a.v_head_dim) * cache.ckv[0].element_size()
        print(f"MLA cache: {latent} B/token (c_kv {a.kv_lora_rank} + k_pe {a.qk_rope_head_dim} per layer) vs full "
              f"K/V {full_kv} B/token ({a.num_attention_heads} heads x (k {a.qk_nope_head_dim + a.qk_rope_head_dim}"
              f" + v {a.v_head_dim})): ratio {latent / full_kv:.4f} ({full_kv / latent:.1f}x smaller)")


if __name__ == "__main__":
    main()
