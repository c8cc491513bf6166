"""Named real models assembled from part packages: sizes checked against each wheel's RECORD before anything is
written, the sha256 of the whole checked, and one clear error for a missing or a truncated part."""
from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys

import pytest

from streamspec_ray.errors import StoreError
from streamspec_ray.store import sources


def _fake_parts(root, chunks: list[bytes], prefix: str = "fakepart") -> None:
    """Installed-looking packages fakepart-1..N, each holding one chunk as data/partNN.bin."""
    for i, chunk in enumerate(chunks, 1):
        mod = root / f"{prefix}_{i}"
        (mod / "data").mkdir(parents=True)
        (mod / "__init__.py").write_text("")
        (mod / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        info = root / f"{prefix}_{i}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}-{i}\nVersion: 0.1\n")
        (info / "RECORD").write_text(f"{prefix}_{i}/__init__.py,,0\n{prefix}_{i}/data/part{i:02d}.bin,,{len(chunk)}\n")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    chunks = [bytes(range(256)) * 40, b"middle" * 1000, b"end" * 77]
    _fake_parts(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    whole = b"".join(chunks)
    named = sources.Named("Fake", "fakepart-{i}", 3, len(whole), hashlib.sha256(whole).hexdigest(), extra="fake")
    monkeypatch.setitem(sources.NAMED, "fake-model", named)
    return tmp_path, whole


def test_assemble_streams_and_checks(fake_model):
    tmp_path, whole = fake_model
    out = sources.assemble("fake-model", str(tmp_path / "out" / "m.gguf"))
    assert open(out, "rb").read() == whole
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.gguf"]


def test_missing_part_is_one_error(fake_model):
    tmp_path, _ = fake_model
    import shutil
    shutil.rmtree(tmp_path / "site" / "fakepart_2")
    importlib.invalidate_caches()
    with pytest.raises(StoreError, match=r"needs 1 more part package\(s\), e\.g\. fakepart-2: pip install "
                                         r"'streamspec-ray\[fake\]'"):
        sources.assemble("fake-model", str(tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()


def test_truncated_part_is_one_error(fake_model):
    tmp_path, _ = fake_model
    part = tmp_path / "site" / "fakepart_3" / "data" / "part03.bin"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(StoreError, match=r"part fakepart-3 is truncated or altered: .* has 221 bytes, its wheel says "
                                         r"231; reinstall it"):
        sources.assemble("fake-model", str(tmp_path / "m.gguf"))
    assert list(tmp_path.glob("m.gguf*")) == []


def test_wrong_content_is_refused(fake_model, monkeypatch):
    tmp_path, whole = fake_model
    monkeypatch.setitem(sources.NAMED, "fake-model", sources.Named("Fake", "fakepart-{i}", 3, len(whole), "0" * 64))
    with pytest.raises(StoreError, match="sha256"):
        sources.assemble("fake-model", str(tmp_path / "m.gguf"))
    assert list(tmp_path.glob("m.gguf*")) == []


def test_cli_names_missing_parts(tmp_path):
    """Without the real parts installed (or with them), `convert` of a named model either works or says which
    packages to install, in one line."""
    missing = [p for p in sources.NAMED["qwen2.5-coder-0.5b"].packages()
               if importlib.util.find_spec(p.replace("-", "_")) is None]
    if not missing:
        pytest.skip("the parts are installed (the real conversion is tested in test_real_pair.py)")
    r = subprocess.run([sys.executable, "-m", "streamspec_ray", "convert", "qwen2.5-coder-0.5b",
                        str(tmp_path / "s")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pip install" in r.stderr, r.stderr
