"""The `streamspec` command line: convert, generate --json (the contract's keys), and the error paths (one
`error:` line on stderr, non-zero exit, no traceback unless --debug).

Most cases call `streamspec_ray.cli.main` in-process (fast); a few run `python -m streamspec_ray` as a real
subprocess, which is what users see."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny
from streamspec_ray import cli
from streamspec_ray.store.convert import convert

CONTRACT_KEYS = {"text", "token_ids", "new_tokens", "mode", "sweeps", "tokens_per_sweep", "bytes_read",
                 "acceptance_rate", "wall_s", "tokens_per_s", "stats"}
STATS_KEYS = {"draft_s", "io_s", "compute_s", "stall_s", "acceptance_per_position"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A per-test STREAMSPEC_HOME, so nothing lands in (or is read from) the user's cache."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("STREAMSPEC_HOME", str(h))
    return str(h)


def run_cli(args: list[str], home: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, STREAMSPEC_HOME=home, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "streamspec_ray", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """cli.main in-process -> (exit code, stdout, stderr). An exception escaping main fails the test: that
    is what a user would see as a traceback."""
    capsys.readouterr()
    try:
        rc = cli.main(args)
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc, err: str, *, contains: str | None = None) -> str:
    assert rc not in (0, None), f"expected a failure, got exit code {rc}"
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {lines!r}"
    assert lines[0].startswith("error:") and len(lines[0]) > len("error: ")
    if contains:
        assert contains.lower() in lines[0].lower(), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def stores(tiny, tmp_path_factory):
    """The tiny store, a corrupt copy of it, and a store of a model with another vocabulary (300 tokens)."""
    root = tmp_path_factory.mktemp("cli")
    corrupt = root / "corrupt"
    shutil.copytree(tiny["store"], corrupt)
    shard = corrupt / "layer.001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    save_tiny(root / "hf300", vocab_size=300)
    convert(str(root / "hf300"), str(root / "store300"))
    return {"store": tiny["store"], "hf": tiny["hf_dir"], "corrupt": str(corrupt), "hf300": str(root / "hf300"),
            "store300": str(root / "store300")}


def assert_hf_greedy(model, prompt: list[int], new: list[int]) -> None:
    """`new` is the HF model's greedy continuation of `prompt`: each token is the argmax after the ones before
    it (one forward over prompt + new checks them all)."""
    assert new
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(new)])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == list(new)


def check_json(stdout: str, mode: str, n: int) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got {stdout!r}"
    d = json.loads(lines[0])
    assert isinstance(d, dict)
    assert CONTRACT_KEYS <= set(d), CONTRACT_KEYS - set(d)
    assert STATS_KEYS <= set(d["stats"]), STATS_KEYS - set(d["stats"])
    assert d["mode"] == mode
    assert d["new_tokens"] == len(d["token_ids"]) <= n
    assert all(isinstance(t, int) for t in d["token_ids"])
    assert d["text"] is None  # the tiny store has no tokenizer
    assert d["sweeps"] >= 1 and d["bytes_read"] > 0
    assert d["tokens_per_sweep"] == pytest.approx(d["new_tokens"] / d["sweeps"])
    assert 0.0 <= d["acceptance_rate"] <= 1.0
    assert d["wall_s"] > 0 and d["tokens_per_s"] > 0
    for k in ("draft_s", "io_s", "compute_s", "stall_s"):
        assert isinstance(d["stats"][k], (int, float)) and d["stats"][k] >= 0
    assert isinstance(d["stats"]["acceptance_per_position"], list)
    return d


# --------------------------------------------------------------------------------------------- happy paths


def test_convert_then_generate_json_subprocess(tiny, tmp_path, home):
    store = str(tmp_path / "store")
    r = run_cli(["convert", tiny["hf_dir"], store, "--dtype", "fp32"], home)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "wrote" in r.stdout and os.path.exists(os.path.join(store, "manifest.msgpack"))

    r = run_cli(["generate", "--target", store, "--prompt-ids", "1,2,3", "--mode", "naive", "--max-new-tokens", "5",
                 "--json"], home)
    assert r.returncode == 0, r.stderr
    d = check_json(r.stdout, "naive", 5)
    assert_hf_greedy(tiny["model"], [1, 2, 3], d["token_ids"])
    assert d["sweeps"] == d["new_tokens"]  # naive: one sweep per token
    # the same folder again without --force: one error line, the store untouched
    before = sorted(os.listdir(store))
    r = run_cli(["convert", tiny["hf_dir"], store], home)
    assert_one_error_line(r.returncode, r.stderr, contains="already exists")
    assert sorted(os.listdir(store)) == before


@pytest.mark.parametrize("draft", ["ngram", "self-int4", "skip:1"])
def test_generate_chain_json(stores, tiny, draft, home, capsys):
    rc, out, err = run_main(["generate", "--target", stores["store"], "--prompt-ids", "1,2,3", "--mode", "chain",
                             "--draft", draft, "--k", "3", "--max-new-tokens", "6", "--json"], capsys)
    assert rc == 0, err
    d = check_json(out, "chain", 6)
    assert d["draft"] == draft
    # greedy chain verification is exact: the same tokens as the target's own greedy decoding
    assert_hf_greedy(tiny["model"], [1, 2, 3], d["token_ids"])
    assert len(d["stats"]["acceptance_per_position"]) <= 3


@pytest.mark.parametrize("budget", ["1", "16", "adaptive"])
def test_generate_tree_json(stores, tiny, budget, home, capsys):
    rc, out, err = run_main(["generate", "--target", stores["store"], "--prompt-ids", "1,2,3", "--mode", "tree",
                             "--budget", budget, "--max-new-tokens", "6", "--json"], capsys)
    assert rc == 0, err
    d = check_json(out, "tree", 6)
    assert_hf_greedy(tiny["model"], [1, 2, 3], d["token_ids"])
    if budget != "adaptive":
        assert max(d["stats"]["nodes_per_round"]) <= int(budget)


def test_generate_plain_output_prints_ids(stores, home, capsys):
    rc, out, err = run_main(["generate", "--target", stores["store"], "--prompt-ids", "1,2,3", "--mode", "naive",
                             "--max-new-tokens", "4"], capsys)
    assert rc == 0, err
    ids = [int(x) for x in out.strip().split(",")]
    assert 1 <= len(ids) <= 4


def test_convert_int4_in_process(tiny, tmp_path, home, capsys):
    out_dir = str(tmp_path / "int4")
    rc, out, err = run_main(["convert", tiny["hf_dir"], out_dir, "--dtype", "int4", "--int4-scheme", "sym"], capsys)
    assert rc == 0, err
    assert "int4" in out
    rc, out, err = run_main(["generate", "--target", out_dir, "--prompt-ids", "1,2,3", "--mode", "naive",
                             "--max-new-tokens", "3", "--json"], capsys)
    assert rc == 0, err
    check_json(out, "naive", 3)


# --------------------------------------------------------------------------------------------- error paths

ERRORS = {
    # name: (args after `generate --target STORE --prompt-ids 1,2,3` unless the args start with "!", text)
    "k0": (["--k", "0"], "--k"),
    "draft-foo": (["--draft", "foo"], "foo"),
    "draft-skip-99": (["--draft", "skip:99"], "99"),
    "draft-skip-all": (["--draft", "skip:0,1,2"], "skip"),
    "draft-skip-bad": (["--draft", "skip:a"], "skip"),
    "temperature": (["--temperature", "-1"], "temperature"),
    "top-p": (["--temperature", "1", "--top-p", "0"], "--top-p"),
    "top-p-big": (["--top-p", "1.5"], "--top-p"),
    "temperature-nan": (["--temperature", "nan"], "--temperature"),
    "top-k": (["--top-k", "-1"], "--top-k"),
    "seed": (["--seed", "-1"], "--seed"),
    "seed-text": (["--seed", "x"], "--seed"),
    "prefetch-depth": (["--prefetch-depth", "-1"], "--prefetch-depth"),
    "threads": (["--threads", "0"], "--threads"),
    "max-new-tokens": (["--max-new-tokens", "0"], "positive"),
    "chat-and-raw": (["--chat", "--raw"], "not allowed with"),
    "empty-prompt": (["!", ""], "empty"),
    "blank-prompt": (["!", "   "], "empty"),
    "empty-prompt-ids": (["!", "--prompt-ids", ","], "empty"),
    "budget-abc": (["--memory-budget", "abc"], "abc"),
    "budget-tiny": (["--mode", "naive", "--memory-budget", "1000"], "memory budget"),
    "tree-budget-0": (["--mode", "tree", "--budget", "0"], "--budget"),
    "tree-budget-abc": (["--mode", "tree", "--budget", "abc"], "--budget"),
    "ray-and-no-ray": (["--ray", "--no-ray"], "not allowed with"),
    "device": (["--device", "foo"], "foo"),
    "token-id": (["!", "--prompt-ids", "1,999", "--mode", "naive"], "999"),
    "prompt-ids-bad": (["!", "--prompt-ids", "1,x"], "prompt-ids"),
    "no-prompt": (["!"], "prompt"),
    "text-no-tokenizer": (["!", "hello", "--mode", "naive"], "tokenizer"),
    "too-long": (["!", "--prompt-ids", ",".join(["5"] * 600), "--mode", "naive"], "context"),
}


def _generate_args(stores, spec) -> list[str]:
    if spec and spec[0] == "!":
        return ["generate", "--target", stores["store"], *spec[1:]]
    return ["generate", "--target", stores["store"], "--prompt-ids", "1,2,3", *spec]


@pytest.mark.parametrize("name", list(ERRORS))
def test_flag_errors(stores, name, home, capsys):
    spec, text = ERRORS[name]
    rc, out, err = run_main(_generate_args(stores, spec), capsys)
    assert_one_error_line(rc, err, contains=text)
    assert out == ""


def test_nonexistent_target(home, capsys):
    rc, out, err = run_main(["generate", "--target", "/nonexistent", "--prompt-ids", "1,2,3"], capsys)
    assert_one_error_line(rc, err, contains="/nonexistent")


def test_target_is_not_a_store(tmp_path, home, capsys):
    (tmp_path / "empty").mkdir()
    rc, out, err = run_main(["generate", "--target", str(tmp_path / "empty"), "--prompt-ids", "1,2,3"], capsys)
    assert_one_error_line(rc, err, contains="no manifest")
    (tmp_path / "notes.txt").write_text("hi")
    rc, out, err = run_main(["generate", "--target", str(tmp_path / "notes.txt"), "--prompt-ids", "1,2,3"], capsys)
    assert_one_error_line(rc, err, contains="is a file, not a store")


@pytest.mark.parametrize("mode", ["naive", "chain"])
def test_corrupt_store(stores, mode, home, capsys):
    rc, out, err = run_main(["generate", "--target", stores["corrupt"], "--prompt-ids", "1,2,3", "--mode", mode,
                             "--draft", "ngram", "--json"], capsys)
    line = assert_one_error_line(rc, err, contains="checksum")
    assert "layer.001.safetensors" in line
    assert out == ""  # no JSON, no tokens from bad bytes


@pytest.mark.parametrize("which", ["store300", "hf300"])
def test_draft_vocab_mismatch(stores, which, home, capsys):
    rc, out, err = run_main(["generate", "--target", stores["store"], "--prompt-ids", "1,2,3", "--draft",
                             stores[which]], capsys)
    line = assert_one_error_line(rc, err, contains="vocabulary")
    assert "300" in line and "256" in line


def test_convert_errors(tiny, tmp_path, home, capsys):
    rc, _, err = run_main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert_one_error_line(rc, err, contains="nope")
    rc, _, err = run_main(["convert", tiny["hf_dir"], str(tmp_path / "out"), "--dtype", "int8"], capsys)
    assert_one_error_line(rc, err, contains="dtype")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    rc, _, err = run_main(["convert", tiny["hf_dir"], str(tmp_path / "taken")], capsys)
    assert_one_error_line(rc, err, contains="already exists")
    assert os.listdir(tmp_path / "taken") == ["x"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- real processes


@pytest.mark.parametrize("case", ["k0", "corrupt", "vocab", "too-long"])
def test_errors_subprocess(stores, case, home):
    args = {
        "k0": ["--target", stores["store"], "--prompt-ids", "1,2,3", "--k", "0"],
        "corrupt": ["--target", stores["corrupt"], "--prompt-ids", "1,2,3", "--mode", "naive"],
        "vocab": ["--target", stores["store"], "--prompt-ids", "1,2,3", "--draft", stores["store300"]],
        "too-long": ["--target", stores["store"], "--prompt-ids", ",".join(["5"] * 600), "--mode", "naive"],
    }[case]
    r = run_cli(["generate", *args], home)
    assert_one_error_line(r.returncode, r.stderr)
    assert r.stdout == ""


def test_debug_shows_traceback(stores, home):
    r = run_cli(["generate", "--target", stores["corrupt"], "--prompt-ids", "1,2,3", "--mode", "naive", "--debug"],
                home)
    assert r.returncode != 0
    assert "Traceback" in r.stderr and "checksum" in r.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_reraises_in_process(stores, where, home):
    from streamspec_ray.errors import StoreError

    args = ["generate", "--target", stores["corrupt"], "--prompt-ids", "1,2,3", "--mode", "naive"]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    with pytest.raises(StoreError, match="checksum"):
        cli.main(args)
