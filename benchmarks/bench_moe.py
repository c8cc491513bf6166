"""Routed experts per streamed sweep on a MoE store: bytes read (the union of routed experts vs every expert) and,
cold, the time a sweep waits for its expert reads, by how they are read.

Builds a random DeepSeek-V3 model with transformers (64 routed experts of ~6.3 MB fp32 each, top-6, 8 groups of
which 4 are kept, one shared expert, first layer dense; ~1.3 GB store), converts it to an fp32 store, then for
each mode runs sweeps of 1, 4, 8 and 16 tokens after a 32-token prefill, cold (each shard's pages are dropped
before it is read). Modes: experts read one at a time after routing (expert_readers=1), 4 at once
(expert_readers=4), and 4 at once with a hot-expert cache (LRU) of a quarter of all experts. Reported per mode
and chunk, medians over the sweeps: the time the sweep waited for expert reads, the sweep's wall time, expert and
whole-sweep bytes read, the cache's hit rate, and whether the logits equal the one-at-a-time mode's bit for bit.
Also the bytes table (union vs every expert) and the MLA cache's bytes per token against a full K/V cache.

    python benchmarks/bench_moe.py [--sweeps 6] [--seed 0]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.store.convert import convert

CONFIG = dict(vocab_size=512, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=64,
              num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1,
              kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
              max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CHUNKS = (1, 4, 8, 16)


def build(folder: str, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **CONFIG), dtype=torch.float32)
    with torch.no_grad():  # the default init (std 0.02) routes almost uniformly at random; keep it, add a bias
        for name, b in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.02)
    model.save_pretrained(folder)


def run_mode(store: str, kw: dict, sweeps: int, seed: int) -> dict:
    """{chunk: [(logits, SweepStats, wall s)] per measured sweep}; the same tokens for every mode."""
    ex = StreamingExecutor(store, cold=True, **kw)
    vocab = ex.args.vocab_size
    out = {}
    for T in CHUNKS:
        gen = torch.Generator().manual_seed(seed + T)
        cache = ex.new_cache()
        ex.sweep(torch.randint(0, vocab, (32,), generator=gen).tolist(), cache)  # prefill
        rows = []
        for _ in range(sweeps):
            t0 = time.perf_counter()
            logits, st = ex.sweep(torch.randint(0, vocab, (T,), generator=gen).tolist(), cache)
            rows.append((logits, st, time.perf_counter() - t0))
        out[T] = rows
    ex.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", type=int, default=6, help="sweeps measured per chunk size and mode")
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    torch.set_num_threads(1)  # 2-core VM: one core computes, the other is left to the reader threads
    with tempfile.TemporaryDirectory() as tmp:
        build(f"{tmp}/hf", opts.seed)
        convert(f"{tmp}/hf", f"{tmp}/store", dtype="fp32")
        ex = StreamingExecutor(f"{tmp}/store")
        a = ex.args
        unit = ex.expert_bytes_all // ex.experts_total
        dense = sum(ex.store.manifest.unit(n).bytes for n in ex.layer_names + ["head"])
        moe_layers = sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
        cache_bytes = ex.expert_bytes_all // 4
        print(f"DeepSeek-V3 random: {a.num_hidden_layers} layers ({moe_layers} MoE), {a.n_routed_experts} experts "
              f"top-{a.num_experts_per_tok}, groups {a.n_group} keep {a.topk_group}; expert shard "
              f"{unit / 1e6:.2f} MB, all experts {ex.expert_bytes_all / 1e6:.1f} MB, layers+head "
              f"{dense / 1e6:.1f} MB per sweep; cold reads, torch threads 1, {opts.sweeps} sweeps per row")
        cache = ex.new_cache()
        ex.sweep([1, 2, 3], cache)
        ex.close()

        modes = {"sync (readers=1)": dict(expert_readers=1),
                 "concurrent (readers=4)": dict(expert_readers=4),
                 f"concurrent + cache {cache_bytes / 1e6:.0f} MB": dict(expert_readers=4, expert_cache=cache_bytes)}
        results = {name: run_mode(f"{tmp}/store", kw, opts.sweeps, opts.seed) for name, kw in modes.items()}
        sync = results["sync (readers=1)"]

        print(f"\n{'chunk':>5} {'experts read/sweep':>19} {'of':>4} {'expert MB':>10} {'all-expert MB':>14} "
              f"{'expert frac':>11} {'sweep MB':>9} {'sweep MB (all)':>15} {'saved':>6}")
        for T in CHUNKS:
            rows = [st for _, st, _ in sync[T]]
            er = statistics.mean(s.experts_read for s in rows)
            eb = statistics.mean(s.expert_bytes for s in rows)
            sb = statistics.mean(s.bytes_read for s in rows)
            full = sb - eb + rows[0].expert_bytes_all
            print(f"{T:>5} {er:>19.1f} {rows[0].experts_total:>4} {eb / 1e6:>10.3f} "
                  f"{rows[0].expert_bytes_all / 1e6:>14.3f} {eb / rows[0].expert_bytes_all:>11.3f} "
                  f"{sb / 1e6:>9.3f} {full / 1e6:>15.3f} {1 - sb / full:>6.1%}")

        print(f"\n{'mode':<28} {'chunk':>5} {'expert stall ms':>15} {'wall ms':>8} {'expert MB':>10} "
              f"{'sweep MB':>9} {'hit rate':>8} {'= sync':>6}")
        for name, res in results.items():
            for T in CHUNKS:
                rows = res[T]
                med = lambda f: statistics.median(f(st, w) for _, st, w in rows)  # noqa: E731
                hits = sum(st.expert_hits for _, st, _ in rows) / sum(st.experts_read for _, st, _ in rows)
                same = all(torch.equal(x, y) for (x, _, _), (y, _, _) in zip(rows, sync[T]))
                print(f"{name:<28} {T:>5} {med(lambda s, w: s.expert_stall_s) * 1e3:>15.1f} "
                      f"{med(lambda s, w: w) * 1e3:>8.1f} {med(lambda s, w: s.expert_bytes) / 1e6:>10.1f} "
                      f"{med(lambda s, w: s.bytes_read) / 1e6:>9.1f} {hits:>8.1%} {str(same):>6}")

        latent = cache.bytes_per_token()
        full_kv = a.num_hidden_layers * a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim
                                                                 + a.v_head_dim) * cache.ckv[0].element_size()
        print(f"\nMLA cache: {latent} B/token (c_kv {a.kv_lora_rank} + k_pe {a.qk_rope_head_dim} per layer) vs full "
              f"K/V {full_kv} B/token ({a.num_attention_heads} heads x (k {a.qk_nope_head_dim + a.qk_rope_head_dim}"
              f" + v {a.v_head_dim})): ratio {latent / full_kv:.4f} ({full_kv / latent:.1f}x smaller)")


if __name__ == "__main__":
    main()
