"""PackedInt8 (quant/int8.py): each row's bits whatever the batch, values close to the int4 weight's, and a target
held in int8 decodes speculatively exactly as it decodes plainly."""
import pytest
import torch

from streamspec_ray.quant.kernel import HAS_KERNEL
from streamspec_ray.quant.int8 import HAS_INT8, PackedInt8, as_int8
from streamspec_ray.quant.packed import quantize

pytestmark = pytest.mark.skipif(not HAS_INT8, reason="no fbgemm / x86 quantized engine in this torch")


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 40  # an outlier channel, as LLM activations have
    x[5] *= 1e-3   # and a row far smaller than the others
    return x


@pytest.mark.parametrize("shape", [(96, 64), (1536, 256), (64, 1536)])
def test_each_row_same_bits_whatever_the_batch(shape):
    w = PackedInt8(torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    x = _x(17, shape[1])
    whole = w(x)
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        assert torch.equal(w(x[:m]), whole[:m])
    for r in range(17):
        assert torch.equal(w(x[r : r + 1]), whole[r : r + 1])
        assert torch.equal(w(x[[r, 16 - r, 0]])[0], whole[r])  # (any position, any neighbours)


def test_close_to_the_float_matmul_and_keeps_shape_and_bias():
    g = torch.Generator().manual_seed(2)
    wf = torch.randn(128, 256, generator=g) * 0.02
    b = torch.randn(128, generator=g)
    x = torch.randn(2, 3, 256, generator=g)
    y = PackedInt8(wf)(x, b)
    ref = torch.nn.functional.linear(x, wf, b)
    assert y.shape == (2, 3, 128) and y.dtype == x.dtype
    assert ((y - ref).norm() / ref.norm()).item() < 0.02


def test_from_int4_holds_the_int4_weights_values():
    if not HAS_KERNEL:
        pytest.skip("no int4 kernel")
    g = torch.Generator().manual_seed(3)
    w4 = quantize(torch.randn(128, 256, generator=g) * 0.05, 32, True, torch.float32)
    w8, added = as_int8({"a.weight": w4, "a.bias": torch.zeros(128)})
    assert isinstance(w8["a.weight"], PackedInt8) and added > 0
    x = torch.randn(4, 256, generator=g)
    ref = torch.nn.functional.linear(x, w4.dense().float())
    assert ((w8["a.weight"](x) - ref).norm() / ref.norm()).item() < 0.02


def test_a_target_held_whole_multiplies_in_int8_and_decodes_speculatively_as_plainly(tmp_path, monkeypatch):
    """Opted in, no limit, an int4pack store held whole: its held units are PackedInt8 (the plan says so), the logits stay
    near the int4 kernel's, and chain and tree give naive's tokens (each row's bits whatever the sweep)."""
    from conftest import TINY_PROMPTS, save_tiny
    from streamspec_ray import Engine
    from streamspec_ray.runtime.executor import HOLD_ENV, INT8_ENV, StreamingExecutor
    from streamspec_ray.runtime.memplan import int4_kernel
    from streamspec_ray.store.convert import convert

    if not HAS_KERNEL:
        pytest.skip("no int4 kernel")
    monkeypatch.setenv(HOLD_ENV, "1")
    monkeypatch.setenv(INT8_ENV, "1")
    save_tiny(tmp_path / "hf", num_hidden_layers=4, seed=8)
    convert(str(tmp_path / "hf"), str(tmp_path / "pack"), dtype="int4pack")
    store = str(tmp_path / "pack")
    ex, ref = StreamingExecutor(store), StreamingExecutor(store, hold_what_fits=False)
    chunks = ([5, 9, 13, 5, 9], [40, 41, 42], [7])
    c1, c2 = ex.new_cache(), ref.new_cache()
    got = [ex.sweep(c, c1)[0] for c in chunks]
    want = [ref.sweep(c, c2)[0] for c in chunks]
    assert ex.memory_plan.kernel == "int8" and ex.memory_plan.as_dict()["kernel"] == "int8"
    assert all(isinstance(w, PackedInt8) for u in ex.held.values() for k, w in u.items() if k.endswith("proj.weight"))
    for a, b in zip(got, want):
        assert not torch.equal(a, b) and ((a - b).norm() / b.norm()).item() < 0.05
    monkeypatch.delenv(INT8_ENV)  # (the default: the int4 weights' own kernel)
    off = StreamingExecutor(store)
    c3 = off.new_cache()
    assert all(torch.equal(off.sweep(c, c3)[0], w) for c, w in zip(chunks, want)) and off.memory_plan.kernel == int4_kernel()
    for e in (ex, ref, off):
        e.close()
    monkeypatch.setenv(INT8_ENV, "1")
    eng = Engine(target=store, draft=store)
    for prompt in TINY_PROMPTS[:2]:
        want = eng.generate(prompt_ids=prompt, max_new_tokens=12, mode="naive").token_ids
        for kw in (dict(mode="chain", k=4), dict(mode="tree", budget=8)):
            assert eng.generate(prompt_ids=prompt, max_new_tokens=12, **kw).token_ids == want, (prompt, kw)
    assert eng.executor.memory_plan.kernel == "int8"


def test_from_int4_a_slab_of_rows_at_a_time_is_the_whole_conversion():
    if not HAS_KERNEL:
        pytest.skip("no int4 kernel")
    g = torch.Generator().manual_seed(4)
    w4 = quantize(torch.randn(320, 128, generator=g) * 0.05, 32, True, torch.float32)
    whole, slabs = PackedInt8.from_int4(w4), PackedInt8.from_int4(w4, slab_bytes=3 * 4 * 128)  # (3 rows a slab)
    x = _x(6, 128)
    assert torch.equal(whole(x), slabs(x))
