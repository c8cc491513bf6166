"""Bad input gets one clear error and loses nothing already written: `convert --force` replaces only a store or
an empty folder, killed conversions' half stores are cleared, two first uses of one model convert it once, a
corrupt shard header is a checksum error, and a malformed GGUF header is one StoreError before any large
allocation."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import subprocess
import sys
import threading

import gguf
import numpy as np
import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.errors import StoreError
from streamspec_ray.runtime.embedding import EmbeddingRows
from streamspec_ray.store import convert as convert_mod
from streamspec_ray.store import outdir, shard
from streamspec_ray.store.convert import convert
from streamspec_ray.store.manifest import MANIFEST, Manifest
from streamspec_ray.store.store import LayerStore
from test_cli import assert_one_error_line, home, run_cli, run_main  # noqa: F401 (home: a per-test STREAMSPEC_HOME)

# --------------------------------------------------------------------------------------------- convert --force


def test_force_never_deletes_a_folder_that_is_not_a_store(tiny, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a store") as e:
        convert(tiny["hf_dir"], str(user), force=True)
    assert str(user) in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(user) == ["notes.txt"] and (user / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "a-file"
    a_file.write_text("also mine")
    with pytest.raises(StoreError, match="is a file") as e:
        convert(tiny["hf_dir"], str(a_file), force=True)
    assert str(a_file) in str(e.value) and a_file.read_text() == "also mine"
    assert sorted(os.listdir(tmp_path)) == ["a-file", "user"]  # (no half store beside them either)


def test_force_replaces_a_store_and_fills_an_empty_folder(tiny, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny["store"], store)
    with pytest.raises(StoreError, match="holds a store .*--force"):  # (without --force: kept)
        convert(tiny["hf_dir"], str(store), dtype="bf16")
    assert Manifest.load(str(store)).dtype == "fp32"
    convert(tiny["hf_dir"], str(store), dtype="bf16", force=True)
    assert Manifest.load(str(store)).dtype == "bf16"
    LayerStore(str(store))
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(tiny["hf_dir"], str(empty), force=True)
    LayerStore(str(empty))
    assert sorted(os.listdir(tmp_path)) == ["empty", "store"]


def test_cli_force_into_a_user_folder_is_one_error_line(tiny, tmp_path, home, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    rc, out, err = run_main(["convert", tiny["hf_dir"], str(user), "--force"], capsys)
    assert_one_error_line(rc, err, contains=str(user))
    assert os.listdir(user) == ["notes.txt"] and out == ""


def test_a_failed_swap_puts_the_old_store_back(tiny, tmp_path, monkeypatch):
    """The new store is renamed into place only when complete, the old one renamed aside first: a rename that
    fails then leaves the old store at OUT, whole."""
    store = tmp_path / "store"
    shutil.copytree(tiny["store"], store)
    real = os.rename

    def rename(a, b):
        if ".partial-" in str(a):
            raise OSError("rename failed (simulated)")
        return real(a, b)

    monkeypatch.setattr(outdir.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        convert(tiny["hf_dir"], str(store), dtype="bf16", force=True)
    assert Manifest.load(str(store)).dtype == "fp32"
    LayerStore(str(store))
    assert os.listdir(tmp_path) == ["store"]


def test_stale_partials_of_dead_processes_are_removed(tiny, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    keep = [f"out.partial-{os.getppid()}",  # a live process's conversion in progress
            f"other.partial-{dead.pid}",  # another OUT's: its own conversion clears it
            "out.partial-notes"]  # not a conversion's name
    for name in keep + [f"out.partial-{dead.pid}"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "layer.000.safetensors").write_bytes(b"half")
    convert(tiny["hf_dir"], str(out))
    LayerStore(str(out))
    assert sorted(os.listdir(tmp_path)) == sorted(keep + ["out"])


# --------------------------------------------------------------------------------------------- first use


def test_two_first_uses_of_one_model_convert_it_once(tmp_path, home, monkeypatch, caplog):
    """The second waits on the lock beside the store while the first converts, then finds the store done."""
    from streamspec_ray.store.default import resolve_store
    from test_gguf import write_llama_gguf

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path)
    real, calls = convert_mod.convert, []
    started, go, waiting = threading.Event(), threading.Event(), threading.Event()

    def held(*a, **kw):  # (the first conversion holds until the second is seen waiting)
        calls.append(a[1])
        started.set()
        go.wait(120)
        return real(*a, **kw)

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for another process" in record.getMessage() and getattr(record, "status", False):
                waiting.set()

    monkeypatch.setattr(convert_mod, "convert", held)
    caplog.set_level(logging.INFO, logger="streamspec")
    handler = Waiting()
    logging.getLogger("streamspec").addHandler(handler)
    got = {}

    def resolve(who):
        try:
            got[who] = resolve_store(str(path))
        except BaseException as e:  # (seen by the asserts below)
            got[who] = e

    threads = {who: threading.Thread(target=resolve, args=(who,)) for who in ("first", "second")}
    try:
        threads["first"].start()
        assert started.wait(120)
        threads["second"].start()
        assert waiting.wait(120), "the second first use did not wait for the first"
    finally:
        go.set()
        for th in threads.values():
            th.join(300)
        logging.getLogger("streamspec").removeHandler(handler)
    assert isinstance(got["first"], str) and got["second"] == got["first"], got
    assert len(calls) == 1
    LayerStore(got["first"])


# --------------------------------------------------------------------------------------------- shard headers


@pytest.mark.parametrize("how", ["garbled", "length"])
def test_corrupt_shard_header_is_a_checksum_error(tiny, tmp_path, how):
    """Checked before the header is parsed, on every read path: not a parse error nor a huge allocation."""
    root = tmp_path / "s"
    shutil.copytree(tiny["store"], root)
    for name in ("layer.001", "embed"):
        with open(root / f"{name}.safetensors", "r+b") as f:  # (its 8-byte header length, or the JSON after it)
            if how == "garbled":
                f.seek(8)
            f.write(struct.pack("<Q", 2**60) if how == "length" else b"\xff")
    store = LayerStore(str(root))
    for verify in (True, False):
        with pytest.raises(StoreError, match=r"checksum mismatch\): .*layer\.001\.safetensors"):
            store.read("layer.001", verify=verify)
    with pytest.raises(StoreError, match="checksum mismatch"):
        Engine(target=str(root), draft=None).logits([1, 2, 3])
    with pytest.raises(StoreError, match=r"checksum mismatch in block 0\): .*embed\.safetensors"):
        EmbeddingRows(store, torch.float32)
    # a store without block checksums (older ones): the whole file is checked first
    m = Manifest.load(str(root))
    m.unit("embed").block_xxh3 = []
    (root / MANIFEST).write_bytes(m.to_bytes())
    with pytest.raises(StoreError, match=r"checksum mismatch\): .*embed\.safetensors"):
        EmbeddingRows(LayerStore(str(root)), torch.float32)
    # and with checksums turned off, one StoreError naming the shard
    with pytest.raises(StoreError, match=r"shard header unreadable: .*layer\.001\.safetensors"):
        LayerStore(str(root), verify=False).read("layer.001")


def test_shard_parse_bounds_offsets(tiny):
    buf = LayerStore(tiny["store"]).read_raw("head")
    short = buf[: buf.numel() - 4]  # (the last tensor now ends past the buffer)
    with pytest.raises(StoreError, match="head.safetensors.*outside the shard"):
        shard.parse(short, "head.safetensors")


# --------------------------------------------------------------------------------------------- GGUF headers

HUGE = 2**62


def _write_small_gguf(path) -> dict[str, int]:
    """A small valid GGUF holding each kind of header field -> the byte offsets of the fields the tests patch."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_string("test.str", "hello")
    w.add_array("test.arr", [1, 2, 3])
    w.add_array("test.strs", ["a", "bc"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields = gguf.GGUFReader(str(path)).fields
    value = {k: fields[k].offset + 8 + len(k) + 4 for k in ("test.u32", "test.str", "test.arr", "test.strs")}
    info = fields["test.strs"].offset + 8 + len("test.strs") + 4 + 12 + (8 + 1) + (8 + 2)  # the tensor's entry
    dims = info + 8 + len("token_embd.weight") + 4
    return {"tensor_count": 8, "kv_count": 16, "u32_key_len": fields["test.u32"].offset,
            "u32_type": value["test.u32"] - 4, "str_len": value["test.str"], "arr_count": value["test.arr"] + 4,
            "strs_count": value["test.strs"] + 4, "strs_first_len": value["test.strs"] + 12,
            "n_dims": dims - 4, "dim0": dims, "tensor_type": dims + 16, "tensor_offset": dims + 20}


PATCHES = {  # name -> (field, value as uint64 | uint32)
    "huge kv count": ("kv_count", "<Q", HUGE), "huge tensor count": ("tensor_count", "<Q", HUGE),
    "huge key length": ("u32_key_len", "<Q", HUGE), "bad value type": ("u32_type", "<I", 99),
    "huge string length": ("str_len", "<Q", HUGE), "huge array count": ("arr_count", "<Q", HUGE),
    "huge string array count": ("strs_count", "<Q", HUGE), "huge string in an array": ("strs_first_len", "<Q", HUGE),
    "huge dims count": ("n_dims", "<I", 2**31), "huge dim": ("dim0", "<Q", HUGE),
    "bad tensor type": ("tensor_type", "<I", 999), "tensor data past the end": ("tensor_offset", "<Q", 2**40),
}


def _bad_gguf(tmp_path, case: str):
    path = tmp_path / "bad.gguf"
    where = _write_small_gguf(path)
    data = bytearray(path.read_bytes())
    if case in PATCHES:
        field, fmt, value = PATCHES[case]
        data[where[field]: where[field] + struct.calcsize(fmt)] = struct.pack(fmt, value)
    elif case == "bad magic":
        data[:4] = b"GGUX"
    elif case == "truncated header":
        data = data[:100]
    elif case == "truncated tensor data":
        data = data[:-16]
    elif case == "empty":
        data = b""
    path.write_bytes(bytes(data))
    return path


def test_small_gguf_offsets_are_the_fields(tmp_path):
    """The fields the cases patch are where _write_small_gguf says (else a case would test something else)."""
    from streamspec_ray.store.gguf import _fast_reader

    path = tmp_path / "ok.gguf"
    where = _write_small_gguf(path)
    data = path.read_bytes()
    u64 = {k: struct.unpack_from("<Q", data, where[k])[0] for k in
           ("tensor_count", "kv_count", "str_len", "arr_count", "strs_count", "strs_first_len", "dim0")}
    assert u64 == {"tensor_count": 1, "kv_count": 5, "str_len": 5, "arr_count": 3, "strs_count": 2,
                   "strs_first_len": 1, "dim0": 8}
    assert struct.unpack_from("<I", data, where["n_dims"])[0] == 2
    assert struct.unpack_from("<I", data, where["tensor_type"])[0] == int(gguf.GGMLQuantizationType.F32)
    assert _fast_reader()(str(path)).fields["test.arr"].contents() == [1, 2, 3]


@pytest.mark.parametrize("case", list(PATCHES) + ["bad magic", "truncated header", "truncated tensor data", "empty"])
def test_malformed_gguf_header_is_one_store_error(tmp_path, case):
    from streamspec_ray.store.gguf import GGUFSource

    path = _bad_gguf(tmp_path, case)
    with pytest.raises(StoreError, match="cannot read .* as GGUF") as e:
        GGUFSource(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_cli_convert_of_a_malformed_gguf_is_one_error_line(tmp_path, home, capsys):
    path = _bad_gguf(tmp_path, "huge array count")
    rc, out, err = run_main(["convert", str(path), str(tmp_path / "out")], capsys)
    assert_one_error_line(rc, err, contains=str(path))
    assert out == "" and not (tmp_path / "out").exists()
    r = run_cli(["convert", str(_bad_gguf(tmp_path, "bad magic")), str(tmp_path / "out")], home)
    assert_one_error_line(r.returncode, r.stderr, contains="GGUF")
    assert r.stdout == "" and not (tmp_path / "out").exists()
