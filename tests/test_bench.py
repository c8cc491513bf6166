"""`streamspec bench` and `streamspec plan` end to end on a tiny store (figures are not asserted: only that
they are measured, consistent and written)."""
import json
import os

from streamspec_ray import bench, plan
from streamspec_ray.cli import main
from streamspec_ray.store.store import LayerStore


def test_bench_rows_outputs_and_files(tiny, tmp_path):
    rec = bench.run(target=tiny["store"], modes=("naive", "chain", "tree:8", "tree"), draft="ngram", k=4, tokens=12,
                    prompts=[[5, 6, 7, 5, 6, 7], [9, 10]], out_dir=str(tmp_path))
    names = [r["name"] for r in rec["rows"]]
    assert names == ["fp32 raw cold read (4 at once)", "fp32 naive", "fp32 chain", "fp32 tree budget 8",
                     "fp32 tree budget adaptive", "fp32 transformers in-memory"]
    curve = rec["sweep_cost"]["fp32"]  # a tree mode ran: sweep time vs tokens measured
    assert [c["tokens"] for c in curve] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(c["seconds"] > 0 and c["bytes_read"] > 0 for c in curve)
    assert "sweep time vs tokens" in bench.markdown(rec)
    assert rec["all_identical"]
    raw = rec["rows"][0]["raw"]
    assert raw["bytes"] > 0 and raw["gb_per_s"] > 0 and raw["readers"] == 4  # as the prefetcher reads at most
    chosen = rec["rows"][1]["chosen"]  # no flags, holding off (conftest): the tiny store read a whole pass ahead
    units = len(LayerStore(tiny["store"]).manifest.layer_units) + 1  # (the layers and the head)
    assert chosen["prefetch_depth"] == chosen["units"] == units and chosen["held_units"] == 0
    assert chosen["direct"] is False
    assert f"0 of {units} units held in memory, {units} units read ahead (the engine's choice)" in bench.markdown(rec)
    naive, chain = rec["rows"][1], rec["rows"][2]
    assert naive["sweeps"] == naive["tokens"] == 24
    assert chain["bytes_per_token"] <= naive["bytes_per_token"]
    assert naive["overlap_efficiency"] <= 1  # tiny shards: thread hand-off can exceed the read, so may be < 0
    for r in rec["rows"][1:-1]:  # the bounds a row is held against: its own reads and compute, its bytes
        assert r["pipeline_bound_s"] >= max(r["io_s"], r["compute_s"]) > 0
        assert r["x_pipeline_bound"] == r["wall_s"] / r["pipeline_bound_s"]
        assert r["draft_bound_s"] == max(r["pipeline_bound_s"], r["compute_s"] + r["draft_s"])
        # the I/O limit is held against the raw bandwidth measured beside the row (before and after it)
        assert r["raw_gb_per_s"] > 0
        assert abs(r["io_limit_s"] - r["bytes_per_token"] * r["tokens"] / (r["raw_gb_per_s"] * 1e9)) < 1e-9
    assert "pipeline bound s (wall x)" in bench.markdown(rec)
    assert os.path.getsize(tmp_path / "bench.png") > 0
    with open(tmp_path / "bench.json") as f:
        saved = json.load(f)
    assert saved["config"]["tokens"] == 12 and "machine" in saved
    assert "| fp32 chain |" in bench.markdown(rec)


def test_plan_says_it_projects_and_from_what(tmp_path, capsys):
    rec = {"rows": [{"name": "fp32 raw cold read", "raw": {"gb_per_s": 2.0}},
                    {"name": "fp32 chain", "mode": "chain", "acceptance": 0.6, "draft_s": 1.0, "proposed": 100,
                     "tokens": 50, "sweeps": 20}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rec))
    assert main(["plan", "--model-bytes", "35GB", "--bench", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (computed, not measured)")
    assert f"measured in {path}" in out
    p = plan.project(35e9, 2.0, 0.6, k=8, draft_s_per_token=0.01)
    assert p["rows"]["naive"]["tokens_per_sweep"] == 1.0
    assert p["rows"]["chain K=8"]["tokens_per_s"] > p["rows"]["naive"]["tokens_per_s"]


def test_bench_overlap_on_and_off(tiny, tmp_path):
    """A /serial mode drafts after each sweep: the same tokens, nothing hidden, no prepared rounds; chain's
    default and /overlap draft during the sweep and report how much of it a round reused (tree's default is
    serial)."""
    rec = bench.run(target=tiny["store"], modes=("naive", "chain", "chain/serial", "tree:8", "tree:8/overlap"),
                    draft=tiny["store"], k=4, tokens=16, prompts=[[5, 6, 7, 5, 6, 7]], out_dir=str(tmp_path), hf=False,
                    sweep_cost=False)
    rows = {r["name"]: r for r in rec["rows"]}
    assert list(rows)[1:] == ["fp32 naive", "fp32 chain", "fp32 chain, serial", "fp32 tree budget 8",
                              "fp32 tree budget 8, overlap"]
    assert rec["all_identical"]
    assert rows["fp32 chain"]["reuse_rate"] is not None and rows["fp32 chain"]["hidden_ms_per_round"] >= 0
    assert rows["fp32 tree budget 8, overlap"]["reuse_rate"] is not None
    for name in ("fp32 chain, serial", "fp32 tree budget 8"):
        assert rows[name]["reuse_rate"] is None and rows[name]["hidden_ms_per_round"] == 0
    assert "draft ms/round (critical / hidden)" in bench.markdown(rec)
    assert main(["bench", "--target", tiny["store"], "--modes", "chain/fast"]) != 0  # (one error line, no run)


def test_a_llama_cpp_run_past_its_time_limit_is_stopped_and_says_so():
    """bench_real_pair's llama.cpp runs stop at --llama-timeout (a repacked run below the file's size thrashes
    for minutes a prompt): the run is an error that says it was stopped, not a hang of the bench."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_real_pair.py")
    spec = importlib.util.spec_from_file_location("bench_real_pair", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = mod.llama_run([sys.executable, "-c", "import time; time.sleep(30)"], [], None, timeout_s=1)
    assert rec["timed_out"] and rec["error"].startswith("stopped after 1 s")
    ok = mod.llama_run([sys.executable, "-c", "pass"], [], None, timeout_s=10)
    assert not ok["timed_out"] and ok["returncode"] == 0
