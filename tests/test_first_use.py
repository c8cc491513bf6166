"""What a new user meets first: the chat template by default (--raw for the text as it is), a GGUF file or a
Hugging Face folder as --target, inputs checked before any loading, one error line for unwritable paths and
out-of-range numbers, Ctrl-C keeping the text generated so far, and batch errors that name IN's line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_cli import assert_one_error_line, home, run_main  # noqa: F401 (home: a per-test STREAMSPEC_HOME)


def _stores(folder: str) -> list[str]:
    """The stores in a folder of first-use conversions (beside each, the lock file its conversion took)."""
    return sorted(p for p in os.listdir(folder) if not p.endswith(".lock"))


def _unwritable(tmp_path) -> str:
    """A folder that cannot be created, even by root: its parent is a regular file."""
    (tmp_path / "a-file").write_text("x")
    return str(tmp_path / "a-file" / "home")


# ---------------------------------------------------------------------------------------- the chat template


def test_text_goes_through_the_chat_template_by_default(smol_engine):
    tok = smol_engine.tokenizer
    templated = list(tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    assert smol_engine.encode("Hello") == templated
    assert smol_engine.encode("Hello", chat=True) == templated
    assert smol_engine.encode("Hello", chat=False) == tok("Hello")["input_ids"]


def test_generate_hello_answers_and_raw_continues(smol_store, capsys, monkeypatch):
    monkeypatch.setenv("STREAMSPEC_HOME", os.path.dirname(smol_store))
    base = ["generate", "Hello", "--target", smol_store, "--mode", "naive", "--max-new-tokens", "12"]
    rc, out, err = run_main(base, capsys)
    assert rc == 0 and "How can I" in out, out  # "Hello! How can I assist you today?"
    rc, raw, err = run_main(base + ["--raw"], capsys)
    assert rc == 0 and raw != out and "How can I" not in raw


def test_chat_on_a_model_without_a_template_is_one_error(tiny, home, capsys):
    from streamspec_ray.engine import encode_prompt

    class NoTemplate:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [1, 2]}

    assert encode_prompt(NoTemplate(), "hi", None, None) == [1, 2]  # no template: the text as it is
    with pytest.raises(Exception, match="no chat template"):
        encode_prompt(NoTemplate(), "hi", None, True)


# --------------------------------------------------------------------------- a GGUF file or HF folder as target


def test_gguf_file_as_target_is_converted_once(tmp_path, home, capsys):
    from test_gguf import write_llama_gguf

    gguf = tmp_path / "tiny.gguf"
    write_llama_gguf(gguf)
    args = ["generate", "--target", str(gguf), "--prompt-ids", "1,2,3", "--mode", "naive", "--max-new-tokens", "3",
            "--json"]
    rc, out, err = run_main(args, capsys)
    assert rc == 0, err
    first = json.loads(out)["token_ids"]
    stores = _stores(os.path.join(home, "gguf"))
    assert len(stores) == 1 and stores[0].startswith("tiny-")
    mtime = os.path.getmtime(os.path.join(home, "gguf", stores[0]))
    rc, out, err = run_main(args, capsys)  # reused, not converted again
    assert rc == 0 and json.loads(out)["token_ids"] == first
    assert _stores(os.path.join(home, "gguf")) == stores
    assert os.path.getmtime(os.path.join(home, "gguf", stores[0])) == mtime


@pytest.mark.parametrize("ftype, want", [(15, "int4pack"), (2, "int4pack"), (1, "fp32"), (7, "fp32"), (None, "fp32")])
def test_a_gguf_files_default_store_follows_its_bits(tmp_path, home, ftype, want):
    """A GGUF of mostly 4-bit blocks (general.file_type Q4_K_M, Q4_0, ...) converts to int4pack, as a named model
    does, unless a dtype is asked for; a 16- or 8-bit file, or one that does not say, to fp32."""
    from test_gguf import write_llama_gguf

    from streamspec_ray.store.default import resolve_store
    from streamspec_ray.store.gguf import file_type
    from streamspec_ray.store.sources import default_dtype

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, file_type=ftype)
    assert file_type(str(path)) == ftype
    assert default_dtype(str(path)) == want
    assert resolve_store(str(path)).endswith("-" + want)
    assert resolve_store(str(path), "fp32").endswith("-fp32")


def test_file_type_reads_only_a_gguf_header(tmp_path):
    from streamspec_ray.store.gguf import file_type
    from streamspec_ray.store.sources import default_gguf

    assert file_type(default_gguf()) == 3  # the embedded SmolLM2 is Q4_1
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)  # truncated
    assert file_type(str(tmp_path / "x.gguf")) is None
    assert file_type(str(tmp_path / "missing.gguf")) is None


def test_an_empty_streamspec_home_is_the_default_one(monkeypatch):
    from streamspec_ray.store.default import home

    monkeypatch.setenv("STREAMSPEC_HOME", "")
    assert home() == os.path.expanduser("~/.cache/streamspec")  # not the folder the command runs in


def test_hf_folder_as_target_matches_its_store(tiny, home, capsys):
    args = ["--prompt-ids", "5,9,13", "--mode", "naive", "--max-new-tokens", "4", "--json"]
    rc, out, err = run_main(["generate", "--target", tiny["hf_dir"], *args], capsys)
    assert rc == 0, err
    rc, ref, err = run_main(["generate", "--target", tiny["store"], *args], capsys)
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]
    assert len(_stores(os.path.join(home, "hf"))) == 1


# ------------------------------------------------------------------------- unwritable paths, numeric ranges


def test_unwritable_home_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMSPEC_HOME", _unwritable(tmp_path))
    rc, out, err = run_main(["generate", "Hello", "--max-new-tokens", "2"], capsys)
    assert_one_error_line(rc, err, contains="STREAMSPEC_HOME")
    assert out == ""


def test_convert_into_an_unwritable_folder_is_one_error_line(tiny, tmp_path, home, capsys):
    rc, out, err = run_main(["convert", tiny["hf_dir"], os.path.join(_unwritable(tmp_path), "store")], capsys)
    assert_one_error_line(rc, err, contains="cannot write")


@pytest.mark.parametrize("flags,text", [
    (["--disk-gbps", "0"], "--disk-gbps"), (["--disk-gbps", "-1"], "--disk-gbps"),
    (["--disk-gbps", "inf"], "--disk-gbps"), (["--disk-gbps", "2", "--acceptance", "1.5"], "--acceptance"),
    (["--disk-gbps", "2", "--acceptance", "0.5", "--draft-ms", "-1"], "--draft-ms"),
    (["--disk-gbps", "2", "--acceptance", "0.5", "--compute-ms", "-3"], "--compute-ms"),
    (["--disk-gbps", "2", "--acceptance", "0.5", "--k", "0"], "positive"),
])
def test_plan_ranges(flags, text, tmp_path, capsys):
    rc, out, err = run_main(["plan", "--model-bytes", "35GB", "--bench", str(tmp_path / "none.json"), *flags],
                            capsys)
    assert_one_error_line(rc, err, contains=text)


def test_plan_with_a_bad_bench_record_is_one_error(tmp_path, capsys):
    (tmp_path / "bench.json").write_text("{not json")
    rc, out, err = run_main(["plan", "--model-bytes", "35GB", "--bench", str(tmp_path / "bench.json")], capsys)
    assert_one_error_line(rc, err, contains="bench.json")


@pytest.mark.parametrize("flags,text", [
    (["--temperature", "-0.5"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-k", "-2"], "--top-k"),
    (["--seed", "1.5"], "--seed"), (["--batch-size", "0"], "positive"), (["--replicas", "0"], "positive"),
    (["--threads", "-1"], "--threads"), (["--max-new-tokens", "-1"], "positive"),
])
def test_batch_ranges(flags, text, tiny, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt_ids": [1, 2]}\n')
    rc, out, err = run_main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--target",
                             tiny["store"], *flags], capsys)
    assert_one_error_line(rc, err, contains=text)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("flags,text", [(["--tokens", "0"], "positive"), (["--prefetch-depth", "-1"],
                                                                           "--prefetch-depth"),
                                        (["--memory-budget=-5MB"], "positive")])
def test_bench_ranges(flags, text, capsys):
    rc, out, err = run_main(["bench", *flags], capsys)
    assert_one_error_line(rc, err, contains=text)


# ----------------------------------------------------------------------------- checks before expensive work


def _no_loading(monkeypatch):
    """Any attempt to build an engine fails the test: the check must come first."""
    def boom(*a, **k):
        raise AssertionError("an engine was built before the input was checked")
    import streamspec_ray.engine
    monkeypatch.setattr(streamspec_ray.engine.Engine, "__init__", boom)


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_empty_prompt_refused_before_loading(prompt, home, monkeypatch, capsys):
    _no_loading(monkeypatch)
    rc, out, err = run_main(["generate", prompt], capsys)
    assert_one_error_line(rc, err, contains="empty")


def test_missing_batch_input_refused_before_loading_and_creates_nothing(tmp_path, home, monkeypatch, capsys):
    _no_loading(monkeypatch)
    out_file = tmp_path / "out.jsonl"
    rc, out, err = run_main(["batch", str(tmp_path / "missing.jsonl"), str(out_file)], capsys)
    assert_one_error_line(rc, err, contains="missing.jsonl")
    assert not out_file.exists()
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    rc, out, err = run_main(["batch", str(tmp_path / "in.jsonl"), os.path.join(_unwritable(tmp_path), "o.jsonl")],
                            capsys)
    assert_one_error_line(rc, err, contains="cannot write")


def test_prompt_too_long_refused_before_the_draft_is_built(tiny, home, monkeypatch, capsys):
    import streamspec_ray.engine

    def no_draft(*a, **k):
        raise AssertionError("the draft was built before the prompt was checked")
    monkeypatch.setattr(streamspec_ray.engine, "make_draft", no_draft)
    rc, out, err = run_main(["generate", "--target", tiny["store"], "--prompt-ids", ",".join(["5"] * 600)], capsys)
    assert_one_error_line(rc, err, contains="context")


# ------------------------------------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_prints_what_was_generated(tiny, home, monkeypatch, capsys):
    from streamspec_ray.speculative import loop

    real = loop.generate

    def interrupted(target, draft, ids, max_new_tokens, *rest):
        # a real generation of 3 tokens, then Ctrl-C arrives
        real(target, draft, ids, 3, *rest)
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "generate", interrupted)
    rc, out, err = run_main(["generate", "--target", tiny["store"], "--prompt-ids", "5,9,13", "--mode", "naive",
                             "--max-new-tokens", "50"], capsys)
    assert rc == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert len(out.strip().split(",")) == 3  # the tiny store has no tokenizer: the ids
    rc, out, err = run_main(["generate", "--target", tiny["store"], "--prompt-ids", "5,9,13", "--mode", "naive",
                             "--max-new-tokens", "50", "--json"], capsys)
    d = json.loads(out)
    assert rc == 130 and d["partial"] and d["finish_reason"] == "interrupted" and d["new_tokens"] == 3


def test_sigint_subprocess_exits_130_without_traceback(smol_store):
    """A real SIGINT to a running generate (the embedded model, naive, 200 tokens: ~20 s): exit 130,
    "interrupted" last on stderr, no traceback."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", STREAMSPEC_HOME=os.path.dirname(smol_store))
    proc = subprocess.Popen([sys.executable, "-m", "streamspec_ray", "generate", "Hello", "--target", smol_store,
                             "--mode", "naive", "--max-new-tokens", "200", "--raw"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(10)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err


# ------------------------------------------------------------------------------------------ batch errors


def test_batch_error_records_name_the_file_line(tiny, tmp_path, capsys):
    rows = ['{"id": 1, "prompt_ids": [1, 2]}', '{"id": 2, "prompt_ids": [1, 2}', "", '{"id": 3}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    rc, out, err = run_main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--target",
                             tiny["store"], "--mode", "naive", "--max-new-tokens", "2"], capsys)
    assert rc == 1
    recs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = {r["line"]: r["error"] for r in recs if "error" in r}
    assert errors[2].startswith("line 2: not valid JSON") and "line 1 column" not in errors[2]
    assert errors[4].startswith("line 4: ")
