"""Exact mode's GPU kernels (``runtime/triton_invariant.py``: GEMM, RMSNorm, attention,
log-softmax), run here on CPU tensors by Triton's interpreter: each row of a result is the same
bits whatever else is in the batch (the property exact mode needs, and the one that does not
depend on the hardware), each is the function it names within float32 rounding, and
``invariant``'s functions dispatch to them where exact mode runs on a GPU.

Triton is part of the test install (``make test``): a missing Triton fails here, it never skips."""

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401 - the install must have it

from jetrl_compile.runtime import fp8_linear, invariant, triton_invariant

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def gpu_kernels(monkeypatch):
    """Exact mode's functions on the Triton kernels, as on a GPU."""
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_gemm_rows_do_not_depend_on_the_batch(dtype):
    """Row r of a 150-row GEMM (three 64-row tiles, K = 200: a partial K step) is the same alone,
    in another batch at another place in its tile, and within float32 summation of the product."""
    torch.manual_seed(0)
    a, b, bias = torch.randn(150, 200).to(dtype), torch.randn(130, 200).to(dtype), torch.randn(130)
    full = triton_invariant.gemm(a, b, bias)
    for rows in (slice(0, 1), slice(70, 71), slice(3, 90), slice(149, 150)):
        assert torch.equal(triton_invariant.gemm(a[rows], b, bias), full[rows]), rows
    moved = torch.cat([a[100:101], a[:7]])
    assert torch.equal(triton_invariant.gemm(moved, b, bias)[0], full[100])
    ref = a.double() @ b.double().t() + bias.double()
    tol = 200 * 2.0**-24 * (a.double().abs() @ b.double().abs().t() + bias.double().abs())
    assert torch.all((full.double() - ref).abs() <= tol)


def test_rms_norm_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    x = torch.randn(5, 7, 200) * 3
    out = triton_invariant.rms_norm(x, 1e-6)
    assert torch.equal(triton_invariant.rms_norm(x[2, 3], 1e-6), out[2, 3])
    assert torch.equal(triton_invariant.rms_norm(x[4:, 1:3], 1e-6), out[4:, 1:3])
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=0)


def test_log_softmax_rows_and_the_sampled_tokens_entry():
    """Over a vocabulary of 3000 (three 1024-blocks, the last partial): a row alone equals the row
    in a batch, a token's logprob equals its entry in the whole row, and masked (-inf) logits give
    -inf without disturbing the rest."""
    torch.manual_seed(2)
    logits = torch.randn(6, 3000) * 4
    logits[3, 2500:] = float("-inf")
    full = triton_invariant.log_softmax(logits)
    tokens = torch.tensor([0, 1023, 1024, 2499, 2999, 7])
    assert torch.equal(triton_invariant.log_softmax(logits, tokens), full.gather(-1, tokens[:, None])[:, 0])
    assert torch.equal(triton_invariant.log_softmax(logits[4:5]), full[4:5])
    assert torch.isinf(full[3, 2500:]).all() and torch.isfinite(full[3, :2500]).all()
    finite = torch.isfinite(full)
    torch.testing.assert_close(full[finite], logits.log_softmax(-1)[finite], rtol=0, atol=2e-5)


def _qkv(b, h, hkv, t, d, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g) for n in (h, hkv, hkv)]


def test_a_decode_query_is_its_row_in_a_padded_and_in_a_packed_batch():
    """The query at position 80 of a sequence, attended alone against keys 0..80 (a decode step),
    gives the same bits as its row in a causal batch, in a batch left-padded by 13, and packed
    after a shared prompt of 30 keys with another sequence's 25 keys between (GRPO's packing):
    one program over the visible keys only, in the same blocks."""
    h, hkv, d, scale = 4, 2, 48, 48**-0.5
    q, k, v = _qkv(1, h, hkv, 100, d)
    alone = torch.ones(1, 1, 81, dtype=torch.bool)
    decode = triton_invariant.attention(q[:, :, 80:81], k[:, :, :81], v[:, :, :81], alone, scale)

    causal = torch.ones(100, 100, dtype=torch.bool).tril()[None]
    assert torch.equal(triton_invariant.attention(q, k, v, causal, scale)[:, :, 80], decode[:, :, 0])

    pad = 13
    qp, kp, vp = (F.pad(t, (0, 0, pad, 0), value=7.0) for t in (q, k, v))  # padding values must not matter
    padded = F.pad(causal, (pad, 0, pad, 0), value=False)
    assert torch.equal(triton_invariant.attention(qp, kp, vp, padded, scale)[:, :, pad + 80], decode[:, :, 0])

    other = 25  # keys 30..54 belong to another completion of the same prompt
    qk = [torch.cat([t[:, :, :30], torch.randn(1, t.shape[1], other, d), t[:, :, 30:]], 2) for t in (q, k, v)]
    visible = torch.zeros(1, 100 + other, 100 + other, dtype=torch.bool)
    visible[0, :, :30] = True
    visible[0, 30 : 30 + other, 30 : 30 + other] = True
    visible[0, 30 + other :, 30 + other :] = True
    visible &= torch.ones_like(visible[0]).tril()
    packed = triton_invariant.attention(*qk, visible, scale)
    assert torch.equal(packed[:, :, other + 80], decode[:, :, 0])


def test_attention_is_softmax_attention_with_grouped_queries():
    h, hkv, d, scale = 6, 2, 40, 0.2
    q, k, v = _qkv(2, h, hkv, 70, d, seed=4)
    visible = torch.ones(70, 70, dtype=torch.bool).tril().expand(2, 70, 70).clone()
    visible[1, :, :9] = False  # left padding: its first 9 queries see no key and get zeros
    out = triton_invariant.attention(q, k, v, visible, scale)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    sees = visible.any(-1)[:, None, :, None]
    torch.testing.assert_close(out, torch.where(sees, ref, 0.0), rtol=0, atol=2e-6)
    assert not out[1, :, :9].any()


def test_a_non_finite_value_reaches_only_the_queries_that_see_it():
    q, k, v = _qkv(1, 2, 2, 20, 16, seed=5)
    v[0, 0, 12, 3] = float("nan")
    out = triton_invariant.attention(q, k, v, torch.ones(20, 20, dtype=torch.bool).tril()[None], 0.25)
    assert torch.isnan(out[0, 0, 12:, 3]).all(), "a query that sees the NaN must carry it"
    out[0, 0, 12:, 3] = 0.0
    assert torch.isfinite(out).all(), "the NaN reached another head, feature or query"


def test_the_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="under Triton's interpreter with TRITON_INTERPRET=1"):
        triton_invariant.rms_norm(torch.randn(2, 8), 1e-6)
    with pytest.raises(TypeError, match="two BF16 or two float32 operands"):
        triton_invariant.gemm(torch.randn(2, 8), torch.randn(3, 8).to(BF16))


def test_exact_mode_takes_them_on_a_gpu_and_the_switch_forces_either(monkeypatch):
    monkeypatch.delenv("JETRL_EXACT_KERNELS", raising=False)
    assert invariant.uses_triton("cuda:0") and not invariant.uses_triton("cpu")
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "torch")
    assert not invariant.uses_triton("cuda:0")
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "triton")
    assert invariant.uses_triton("cpu")
    monkeypatch.setenv("JETRL_EXACT_KERNELS", "float64")
    with pytest.raises(ValueError, match="JETRL_EXACT_KERNELS='float64' is unknown; choose one of auto, torch, triton"):
        invariant.uses_triton("cpu")


def test_invariant_functions_run_the_kernels_and_keep_their_gradients(gpu_kernels):
    """Through ``invariant``: RMSNorm, the unquantized linear, token logprobs and attention give
    the kernels' bits, and their backward rules are the usual formulas (here against the torch
    path's gradients, which are the same formulas)."""
    torch.manual_seed(6)
    x, w = torch.randn(9, 200, requires_grad=True), torch.randn(200) + 1
    y = invariant.rms_norm(x, w, 1e-5)
    assert torch.equal(y, w * triton_invariant.rms_norm(x.detach(), 1e-5))
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    lin = torch.randn(64, 200)
    z = invariant.linear(y.detach(), lin)
    assert torch.equal(z, triton_invariant.gemm(y.detach(), lin))
    tokens = torch.randint(0, 64, (9,))
    lp = invariant.token_logprobs(z, tokens)
    assert torch.equal(lp, triton_invariant.log_softmax(z, tokens))
    assert torch.equal(invariant.log_softmax(z).gather(-1, tokens[:, None])[:, 0], lp)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("JETRL_EXACT_KERNELS", "torch")
        x2 = x.detach().requires_grad_()
        (dx_ref,) = torch.autograd.grad(invariant.rms_norm(x2, w, 1e-5).square().sum(), x2)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-4, atol=1e-5)


def test_a_bf16_fprop_in_exact_mode_is_the_invariant_gemm(gpu_kernels):
    """Exact mode's BF16 fprop (the bf16 recipe, or an FP8 one on emulated FP8 GEMMs) runs the
    Triton GEMM on the BF16 operands: no fixed-point float64 operand, rows batch-invariant."""
    torch.manual_seed(7)
    x, w = torch.randn(70, 200), torch.randn(96, 200) * 0.1
    y = fp8_linear(x, w, recipe="bf16", exact=True)
    assert torch.equal(y, triton_invariant.gemm(x.to(BF16), w.to(BF16)).to(BF16).float())
    assert torch.equal(fp8_linear(x[33:34], w, recipe="bf16", exact=True), y[33:34])
    q = fp8_linear(x, w, recipe="fp8_fwd_bf16_bwd", exact=True)  # emulated FP8 here: the same GEMM
    assert torch.equal(fp8_linear(x[69:], w, recipe="fp8_fwd_bf16_bwd", exact=True), q[69:])
    assert not torch.equal(q, y), "the FP8 fprop quantized nothing: the comparison would be vacuous"

