import pytest
import torch

from streamspec_ray.quant import GROUP_SIZE, can_quantize, dequantize_int4, quant_report, quantize_int4


def _exact_weight(out=8, inp=256, g=GROUP_SIZE, seed=0):
    """A weight q * s with q in -7..7 (each group's absmax code is +-7) and s an fp16 value."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, (out, inp), generator=gen)
    q.view(out, inp // g, g)[..., 0] = torch.where(torch.rand(out, inp // g, generator=gen) < 0.5, -7, 7)
    s = (torch.rand(out, inp // g, generator=gen) * 0.1 + 1e-3).to(torch.float16)  # [out, G]
    w = (q.view(out, -1, g).float() * s.float()[..., None]).view(out, inp)  # exact in fp32
    return w, q, s


def test_shapes_and_dtypes():
    w = torch.randn(96, 192)
    qw, sc = quantize_int4(w)
    assert qw.shape == (96, 96) and qw.dtype == torch.uint8
    assert sc.shape == (96, 3) and sc.dtype == torch.float16
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        wd = dequantize_int4(qw, sc, dtype=dt)
        assert wd.shape == (96, 192) and wd.dtype == dt
    qw, sc = quantize_int4(torch.randn(4, 64).to(torch.bfloat16), group_size=32)
    assert qw.shape == (4, 32) and sc.shape == (4, 2)
    assert dequantize_int4(qw, sc, group_size=32).shape == (4, 64)


def test_exact_roundtrip_and_nibble_layout():
    w, q, s = _exact_weight()
    qw, sc = quantize_int4(w)
    assert torch.equal(sc, s)
    u = (q + 8).to(torch.uint8)
    assert torch.equal(qw & 0x0F, u[:, 0::2])  # low nibble = even column
    assert torch.equal(qw >> 4, u[:, 1::2])  # high nibble = odd column
    assert torch.equal(dequantize_int4(qw, sc), w)


def test_error_bound_per_element():
    w = torch.randn(64, 512) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    qw, sc = quantize_int4(w)
    err = (dequantize_int4(qw, sc) - w).abs().view(64, -1, GROUP_SIZE)
    bound = sc.float()[..., None] / 2
    assert (err <= bound * (1 + 1e-6)).all()
    assert (sc.float() * 7 >= w.abs().view(64, -1, GROUP_SIZE).amax(-1)).all()  # scale rounded up


def test_zero_groups():
    w = torch.randn(4, 256)
    w[1] = 0  # a whole zero row
    w[2, 64:128] = 0  # one zero group
    w[3, :64] = 1e-9  # below fp16 resolution
    qw, sc = quantize_int4(w)
    assert torch.isfinite(sc).all() and (sc > 0).all()
    wd = dequantize_int4(qw, sc)
    assert torch.isfinite(wd).all()
    assert (wd[1] == 0).all() and (wd[2, 64:128] == 0).all()
    assert (wd[3, :64] - 1e-9).abs().max() <= 1e-9
    r = quant_report(torch.zeros(8, 64))
    assert r["max_abs_err"] == 0.0


def test_bytes_per_param():
    assert quant_report(torch.randn(16, 128))["bytes_per_param"] == 0.53125


def test_cosine_gaussian():
    w = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
    r = quant_report(w)
    assert r["cosine"] >= 0.99
    assert 0 < r["max_abs_err"] < 1.0


@pytest.mark.parametrize(
    "name,shape,ok",
    [
        ("model.layers.0.self_attn.q_proj.weight", (576, 576), True),
        ("model.layers.0.mlp.down_proj.weight", torch.Size([576, 1536]), True),
        ("model.layers.0.input_layernorm.weight", (576,), False),
        ("model.norm.weight", (576,), False),
        ("model.layers.0.self_attn.q_proj.bias", (576,), False),
        ("some.weight", (576, 100), False),  # 100 % 64 != 0
        ("some.weight", (64, 96), False),
        ("some.weight", (2, 3, 64), False),
    ],
)
def test_can_quantize(name, shape, ok):
    assert can_quantize(name, shape) is ok


@pytest.mark.parametrize("out", [96, 100, 72])
def test_packed_int4_matches_dequantized_matmul_any_shape(out):
    """The resident-draft INT4 matmul (torch's int4 kernel where the shape allows, else dequantized)."""
    from streamspec_ray.quant import quantize_int4_asym
    from streamspec_ray.quant.packed import PackedInt4

    w = torch.randn(out, 128, generator=torch.Generator().manual_seed(out)) * 0.05
    q, s, z = quantize_int4_asym(w)
    x = torch.randn(3, 128)
    ref = x @ dequantize_int4(q, s, zeros=z).t()
    got = PackedInt4(q, s, 64, zeros=z)(x)
    assert got.shape == (3, out)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()  # the kernel runs in bf16
