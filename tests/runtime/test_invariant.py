"""Invariant numerics (exact mode): each op gives a row the same bits alone, in batches of 1..64
rows, as decode against a cache and inside a full sequence, with and without padding, and stays
close to the textbook function."""

import math

import pytest
import torch
import torch.nn.functional as F

from jetrl_compile.runtime import invariant
from jetrl_compile.runtime.quantize import dequantize, quantize_blockwise, quantize_groupwise

BATCHES = [1, 2, 3, 7, 8, 16, 33, 64]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_exp_is_close_to_torch_and_handles_specials():
    x = torch.randn(200_000, generator=_gen()) * 30
    got, ref = invariant.exp(x), torch.exp(x.double())
    normal = (ref > 2.0**-126) & (ref < 3e38)
    ulp = ref[normal].float().abs() * 2.0**-23
    assert ((got[normal].double() - ref[normal]).abs() <= 2 * ulp.double()).all()
    specials = invariant.exp(torch.tensor([-math.inf, math.inf, math.nan, 0.0, -200.0, 89.0]))
    assert specials[0] == 0 and specials[1] == math.inf and specials[2].isnan() and specials[3] == 1
    assert specials[4] == 0 and specials[5] == math.inf


@pytest.mark.parametrize("size", [1, 5, 31, 33, 1000, 40_000, 100_003])
def test_exp_of_a_value_does_not_depend_on_where_it_sits(size):
    """torch.exp computes a vector loop's tail with the scalar function; ours has one path."""
    x = torch.randn(size, generator=_gen(1)) * 10
    alone = torch.stack([invariant.exp(x[i : i + 1])[0] for i in range(0, size, max(1, size // 37))])
    assert torch.equal(invariant.exp(x)[:: max(1, size // 37)], alone)


def test_log_is_close_and_handles_specials():
    x = torch.rand(10_000, generator=_gen()) * 1e4 + 1e-3
    ref = x.double().log()
    assert ((invariant.log(x).double() - ref).abs() <= ref.abs() * 2.0**-23 + 1e-30).all()  # within an ulp
    out = invariant.log(torch.tensor([0.0, -1.0, math.inf, math.nan, 1.0]))
    assert out[0] == -math.inf and out[1].isnan() and out[2] == math.inf and out[3].isnan() and out[4] == 0


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200, 4097])
def test_tree_sum_ignores_trailing_zeros_and_other_rows(length):
    x = torch.randn(5, length, generator=_gen(2))
    s = invariant.tree_sum(x)
    for extra in (1, 64, 1000):
        assert torch.equal(invariant.tree_sum(F.pad(x, (0, extra))), s)
    assert torch.equal(invariant.tree_sum(x[2:3]), s[2:3])
    assert torch.equal(invariant.tree_sum(x.t().contiguous(), dim=0), s)
    assert (s.double() - x.double().sum(-1)).abs().max() < 1e-5 * math.sqrt(length)


def _int_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The invariant GEMM's result, computed independently of any float BLAS: each 128-block's dot
    product as int64, scaled and added in order."""
    fa, fb = invariant.FixedPoint(a), invariant.FixedPoint(b)
    out = torch.zeros(fa.rows, fb.rows, dtype=torch.float64)
    for blk in range(fa.values.shape[0]):
        va, vb = fa.values[blk], fb.values[blk]
        bits = invariant.FIXED_POINT_BITS
        sa = 2.0 ** (torch.frexp(va.abs().amax(-1, keepdim=True)).exponent.double() - bits)
        sb = 2.0 ** (torch.frexp(vb.abs().amax(-1, keepdim=True)).exponent.double() - bits)
        ia, ib = (va / sa).to(torch.int64), (vb / sb).to(torch.int64)
        assert torch.equal(ia.double() * sa, va) and torch.equal(ib.double() * sb, vb)  # integers on the grid
        out = out + (ia @ ib.t()).double() * (sa * sb.t())
    return out


@pytest.mark.parametrize("shape", [(37, 200, 300), (64, 576, 192), (5, 1536, 576)])
def test_gemm_of_fp8_operands_is_exact_and_row_invariant(shape):
    m, k, n = shape
    x = dequantize(*quantize_groupwise(torch.randn(m, k, generator=_gen(3)) * 3), torch.float32)
    w = dequantize(*quantize_blockwise(torch.randn(n, k, generator=_gen(4)) * 0.05), torch.float32)
    got = invariant.gemm(x, w)
    assert torch.equal(got, _int_reference(x, w))
    # FP8 operands sit on the fixed-point grid: the GEMM is the exact sum per block
    assert (got - x.double() @ w.double().t()).abs().max() < 1e-9 * (x.double().abs() @ w.double().abs().t()).max()
    fixed = invariant.FixedPoint(w)
    for rows in BATCHES:
        assert torch.equal(invariant.gemm(x[:rows], fixed), got[:rows]), rows
    assert torch.equal(invariant.gemm(x[m // 2 : m // 2 + 1], w), got[m // 2 : m // 2 + 1])


def test_gemm_rounds_other_operands_to_the_fixed_point_grid():
    a = torch.randn(9, 300, generator=_gen(5), dtype=torch.float64)
    b = torch.randn(11, 300, generator=_gen(6), dtype=torch.float64)
    bias = torch.randn(11, generator=_gen(7))
    got = invariant.gemm(a, b, bias=bias)
    assert torch.equal(got, _int_reference(a, b) + bias.double())
    assert (got - bias.double() - a @ b.t()).abs().max() < 1e-4  # 22 bits below each block's largest element
    with pytest.raises(ValueError, match="K=300 .* but b has K=200"):
        invariant.gemm(a, b[:, :200])


def test_linear_is_one_exact_gemm_per_row_and_row_invariant():
    """Unquantized linears (lm_head) use one fixed-point block per row: 21 bits below the row's
    largest element for K = 576, so one float64 GEMM sums integers exactly."""
    x = torch.randn(64, 576, generator=_gen(22))
    w = torch.randn(300, 576, generator=_gen(23))
    fixed = invariant.FixedPoint(w, block=None)
    assert fixed.values.shape == (1, 300, 576)
    scale = 2.0 ** (torch.frexp(w.double().abs().amax(-1, keepdim=True)).exponent.double() - 21)
    ints = fixed.values[0] / scale
    assert torch.equal(ints, ints.round()) and ints.abs().max() <= 2**21
    y = invariant.linear(x, w, weight_fixed=fixed)
    for rows in BATCHES:
        assert torch.equal(invariant.linear(x[-rows:], w, weight_fixed=fixed), y[-rows:])
    assert torch.equal(invariant.linear(x[:5], w)[:5], y[:5])  # the same operand when made on the fly
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)


def test_linear_backward_is_f_linear():
    x = torch.randn(6, 200, generator=_gen(7), requires_grad=True)
    w = torch.randn(50, 200, generator=_gen(8), requires_grad=True)
    b = torch.randn(50, generator=_gen(9), requires_grad=True)
    dy = torch.randn(6, 50, generator=_gen(10))
    grads = torch.autograd.grad(invariant.linear(x, w, b), (x, w, b), dy)
    ref = torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_rms_norm_rows_alone_and_in_batches():
    x = torch.randn(64, 200, generator=_gen(11)) * 4
    w = torch.rand(200, generator=_gen(12)) + 0.5
    full = invariant.rms_norm(x, w, 1e-6)
    for rows in BATCHES:
        assert torch.equal(invariant.rms_norm(x[-rows:], w, 1e-6), full[-rows:])
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)


def test_silu_is_close_and_row_invariant():
    x = torch.randn(64, 320, generator=_gen(13), requires_grad=True) * 5
    y = invariant.silu(x)
    torch.testing.assert_close(y, F.silu(x), rtol=3e-6, atol=1e-6)
    for rows in BATCHES:
        assert torch.equal(invariant.silu(x[:rows]), y[:rows])
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(F.silu(x), x, dy)[0])


def _qkv(b, h, hkv, t, d, seed):
    g = _gen(seed)
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g).bfloat16().float()
    return q, k, v


def _causal(b, tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq).expand(b, tq, tk)


def test_attention_decode_full_sequence_padding_and_packing_agree():
    """One sequence's query at position t: computed as decode (one query against keys 0..t),
    inside the full causal sequence, left-padded in a batch, and packed after another sequence
    whose keys it must not see: the same bits every time."""
    h, hkv, t, d, scale = 4, 2, 70, 50, 50**-0.5
    q, k, v = _qkv(1, h, hkv, t, d, seed=14)
    full = invariant.attention(q, k, v, _causal(1, t, t), scale)
    for pos in (0, 1, 37, 64, t - 1):
        decode = invariant.attention(q[:, :, pos : pos + 1], k[:, :, : pos + 1], v[:, :, : pos + 1],
                                     _causal(1, 1, pos + 1), scale)
        assert torch.equal(decode[:, :, 0], full[:, :, pos]), pos
    # left padding by 9 (padding keys hold garbage, NaN included), in a batch of 3 rows
    pad = 9
    qp, kp, vp = (F.pad(x, (0, 0, pad, 0), value=float("nan")) for x in (q, k, v))
    visible = _causal(1, t + pad, t + pad).clone()
    visible[:, :, :pad] = False
    others = _qkv(2, h, hkv, t + pad, d, seed=15)
    batch = [torch.cat([x, y]) for x, y in zip((qp, kp, vp), others)]
    vis = torch.cat([visible, _causal(2, t + pad, t + pad)])
    padded = invariant.attention(*batch, vis, scale)
    assert torch.equal(padded[0, :, pad:], full[0])
    # packed: another sequence of 20 tokens first, invisible to ours
    o = _qkv(1, h, hkv, 20, d, seed=16)
    packed = [torch.cat([x, y], dim=2) for x, y in zip(o, (q, k, v))]
    vis = torch.zeros(1, 20 + t, 20 + t, dtype=torch.bool)
    vis[:, :20, :20] = _causal(1, 20, 20)
    vis[:, 20:, 20:] = _causal(1, t, t)
    assert torch.equal(invariant.attention(*packed, vis, scale)[:, :, 20:], full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_close_to_sdpa_with_sdpa_gradients(dtype):
    q, k, v = (x.to(dtype).requires_grad_() for x in _qkv(2, 4, 2, 40, 32, seed=17))
    vis = _causal(2, 40, 40)
    out = invariant.attention(q, k, v, vis, 32**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], scale=32**-0.5, enable_gqa=True)
    # FP32: V in per-row fixed point of 12-16 bits (design.md, section 8), below BF16 resolution
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=4e-4)
    torch.testing.assert_close(out, ref, **tol)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r)


def test_attention_refusals_and_empty_rows():
    q, k, v = _qkv(1, 3, 2, 4, 8, seed=18)
    with pytest.raises(ValueError, match="multiple of key heads"):
        invariant.attention(q, k, v, _causal(1, 4, 4), 1.0)
    q, k, v = _qkv(1, 2, 1, 4, 8, seed=18)
    vis = _causal(1, 4, 4).clone()
    vis[:, 0] = False  # a padding query that sees nothing gets zeros, not NaN
    out = invariant.attention(q, k, v, vis, 1.0)
    assert torch.equal(out[:, :, 0], torch.zeros(1, 2, 8)) and out.isfinite().all()
    v[0, 0, 2, 3] = math.nan  # a NaN value reaches the queries that see its key, and only those
    out = invariant.attention(q, k, v, _causal(1, 4, 4), 1.0)
    assert out[:, :, :2].isfinite().all() and out[:, :, 2:, 3].isnan().all() and out[:, :, 2:, :3].isfinite().all()


def test_token_logprobs_close_invariant_and_differentiable():
    logits = torch.randn(50, 3000, generator=_gen(19), requires_grad=True) * 4
    tokens = torch.randint(0, 3000, (50,), generator=_gen(20))
    lp = invariant.token_logprobs(logits, tokens)
    ref = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=2e-5)
    for rows in BATCHES[:-1]:
        assert torch.equal(invariant.token_logprobs(logits[:rows], tokens[:rows]), lp[:rows])
    dlp = torch.randn(50, generator=_gen(21))
    torch.testing.assert_close(torch.autograd.grad(lp, logits, dlp)[0], torch.autograd.grad(ref, logits, dlp)[0])
