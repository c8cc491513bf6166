"""The 4-bit x 8-bit kernel (quant/q4q8.py): the int4pack layout read right (against the formula in float64), each
row's bits whatever the batch, the vector path equal to the scalar one, the error of 8-bit activations, and the
fallback to torch's kernel where it cannot be built."""
import numpy as np
import pytest
import torch

from streamspec_ray.quant import kernel, q4q8
from streamspec_ray.quant.packed import PackedInt4, int4_input_dtype, row_invariant

pytestmark = pytest.mark.skipif(not q4q8.available(), reason="no AVX512-VNNI / C compiler / AVX512 int4 layout here")


def _weight(n: int, k: int, seed: int = 0, group: int = 32):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    z = torch.randn(n, k // group, generator=g) * 0.01
    p = kernel.pack(u, s, z)
    sz = p["scales_zeros"].float()
    w = kernel.dequantize(u.numpy(), sz[..., 0].t().numpy(), sz[..., 1].t().numpy())
    return p, torch.from_numpy(w)


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 40      # an outlier channel
    x[5] *= 1e-3       # a row far smaller than the others
    x[6] = 0           # and an empty one
    return x


def _reference(x: torch.Tensor, p: dict, group: int) -> torch.Tensor:
    """The module's formula in float64 from the codes read back by kernel.unpack_codes (numpy)."""
    m, k = x.shape
    u = torch.from_numpy(kernel.unpack_codes(p["qweight"], k)).double()                  # [N, K]
    sz = p["scales_zeros"].double()
    s, z = sz[..., 0].t(), sz[..., 1].t()                                                  # [N, G]
    xg = x.float().view(m, -1, group)
    mx = xg.abs().amax(-1, keepdim=True)
    sc = (mx / 127).view(torch.int32)                                                    # (fp32, as the C code)
    sc = torch.where(sc & 0xFFFF != 0, (sc | 0xFFFF) + 1, sc).view(torch.float32)        # rounded up to bf16
    inv = torch.where(mx > 0, 1 / sc, torch.zeros_like(mx))
    a = torch.round(xg * inv).clamp(-127, 127).double()                                  # [M, G, group]
    xs = torch.where(mx > 0, sc, torch.zeros_like(sc)).double().squeeze(-1)              # [M, G]
    ua = torch.einsum("mgj,ngj->mng", a, u.view(u.shape[0], -1, group))                  # [M, N, G]
    return (xs[:, None] * (s[None] * ua + (z - 8 * s)[None] * a.sum(-1)[:, None])).sum(-1)


@pytest.mark.parametrize("shape", [(128, 64), (1536, 256), (256, 1536), (112, 96), (176, 64)])
def test_reads_the_int4pack_layout_and_computes_the_formula(shape):
    """(112, 176: a last block of 48 and 48 rows in adjacent pairs, through the scalar path.)"""
    n, k = shape
    p, _ = _weight(n, k)
    x = _x(9, k)
    y = q4q8.mm(x, p["qweight"], p["scales_zeros"], 32)
    ref = _reference(x, p, 32)
    assert y.shape == (9, n) and y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    assert torch.equal(y[6], torch.zeros(n))


@pytest.mark.parametrize("shape", [(128, 64), (192, 1536), (80, 128)])
def test_each_row_same_bits_whatever_the_batch_and_the_path(shape):
    n, k = shape
    p, _ = _weight(n, k, seed=2)
    x = _x(17, k, seed=3)
    whole = q4q8.mm(x, p["qweight"], p["scales_zeros"], 32)
    assert torch.equal(q4q8.mm(x, p["qweight"], p["scales_zeros"], 32, scalar=True), whole)
    for m in (1, 2, 3, 4, 5, 8, 9, 16):
        assert torch.equal(q4q8.mm(x[:m], p["qweight"], p["scales_zeros"], 32), whole[:m])
    for r in range(17):
        assert torch.equal(q4q8.mm(x[[r, 16 - r, 0]], p["qweight"], p["scales_zeros"], 32)[0], whole[r])


@pytest.mark.parametrize("group", [32, 64, 128])
def test_eight_bit_activations_stay_close_to_the_float_product(group):
    p, w = _weight(256, 512, seed=4, group=group)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    y = q4q8.mm(x, p["qweight"], p["scales_zeros"], group)
    ref = x @ w.t()
    assert ((y - ref).norm() / ref.norm()).item() < 0.01


def test_packed_int4_multiplies_through_it_row_invariantly():
    p, w = _weight(128, 256, seed=6)
    pw = PackedInt4.from_packed(p["qweight"], p["scales_zeros"], 32)
    x = torch.randn(2, 3, 256)
    assert int4_input_dtype() == torch.float32 and row_invariant(pw)
    y = pw(x)
    assert y.shape == (2, 3, 128)
    assert torch.equal(y.view(6, 128), q4q8.mm(x.view(6, 256), p["qweight"], p["scales_zeros"], 32))


def test_bad_shapes_and_dtypes_are_one_clear_error():
    p, _ = _weight(128, 64)
    with pytest.raises(ValueError, match="q4q8.mm"):
        q4q8.mm(torch.randn(2, 96), p["qweight"], p["scales_zeros"], 32)
    with pytest.raises(ValueError, match="q4q8.mm"):
        q4q8.mm(torch.randn(2, 64), p["qweight"], p["scales_zeros"].float(), 32)
    with pytest.raises(ValueError, match="q4q8.mm"):
        q4q8.mm(torch.randn(2, 64), p["qweight"].t().contiguous().t(), p["scales_zeros"], 32)


@pytest.fixture
def fresh_library():
    q4q8.library.cache_clear()
    yield
    q4q8.library.cache_clear()


def test_turned_off_or_unbuildable_it_leaves_torchs_kernel(monkeypatch, tmp_path, fresh_library):
    monkeypatch.setenv(q4q8.ENV, "0")
    assert not q4q8.available() and int4_input_dtype() == torch.bfloat16
    q4q8.library.cache_clear()
    monkeypatch.delenv(q4q8.ENV)
    monkeypatch.setenv("STREAMSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")   # a "compiler" that fails
    assert not q4q8.available()
    assert not any(tmp_path.rglob("*.so"))  # nothing half-written left behind
    q4q8.library.cache_clear()
    monkeypatch.delenv("CC")
    assert q4q8.available() and any(tmp_path.rglob("q4q8-*.so"))   # built on first use into $STREAMSPEC_HOME


def test_a_row_of_x_in_bf16_or_fp16_is_taken_as_fp32():
    p, _ = _weight(128, 64, seed=7)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(q4q8.mm(x, p["qweight"], p["scales_zeros"], 32),
                       q4q8.mm(x.float(), p["qweight"], p["scales_zeros"], 32))
    assert np.isfinite(q4q8.mm(x, p["qweight"], p["scales_zeros"], 32).numpy()).all()
