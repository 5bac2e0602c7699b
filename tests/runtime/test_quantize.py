"""The one quantizer (docs/design.md, section 2), pinned element by element."""

import math
import os
from pathlib import Path

import pytest
import torch

from jetrl_compile.runtime import FP8_DTYPE, FP8_MAX, dequantize, quantize_blockwise, quantize_groupwise
from jetrl_compile.runtime.quantize import cast_saturated, expand_block_scale
from tests.conftest import assert_same_quantization

SHAPES = [(576, 1536), (1536, 576), (192, 576), (200, 300), (129, 257), (128, 128), (1, 5)]


def _e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half an E4M3 ulp at magnitude v (v = |x| / s <= 448): 3 mantissa bits, min normal 2**-6."""
    exponent = torch.floor(torch.log2(v.clamp_min(2.0**-6)))
    return torch.exp2(exponent - 4)


def _assert_power_of_two(scale: torch.Tensor):
    mantissa, _ = torch.frexp(scale)
    assert scale.dtype == torch.float32
    assert torch.all(mantissa == 0.5), "every scale is an exact power of two"


@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise_round_trip_within_half_ulp_of_each_block_scale(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different size
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    _assert_power_of_two(s)
    full_scale = expand_block_scale(s, shape)
    err = (dequantize(q, s, torch.float32) - w).abs()
    assert torch.all(err <= _e4m3_half_ulp(w.abs() / full_scale) * full_scale)


@pytest.mark.parametrize("shape", [(4, 7, 200), (3, 576), (2, 1536), (5, 128), (1, 1)])
def test_groupwise_round_trip_within_half_ulp_of_each_group_scale(shape):
    torch.manual_seed(1)
    x = (torch.randn(shape) * 5).to(torch.bfloat16)
    q, s = quantize_groupwise(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], math.ceil(shape[-1] / 128))
    _assert_power_of_two(s)
    deq = dequantize(q, s, torch.float32)
    full_scale = deq.new_empty(shape)
    for g in range(s.shape[-1]):
        full_scale[..., g * 128 : (g + 1) * 128] = s[..., g : g + 1]
    assert torch.all((deq - x.float()).abs() <= _e4m3_half_ulp(x.float().abs() / full_scale) * full_scale)


def test_scale_is_the_smallest_power_of_two_covering_amax():
    amax = torch.tensor([448.0, 448.0001, 1.0, 2.0**-20, 3e38, 224.0, 224.00002])
    x = torch.zeros(len(amax), 128)
    x[:, 3] = amax
    _, s = quantize_groupwise(x)
    s = s.squeeze(-1)
    assert torch.all(amax <= FP8_MAX * s), "no group saturates"
    assert torch.all(amax > FP8_MAX * (s / 2)), "and no smaller power of two would do"
    assert s[0] == 1.0 and s[1] == 2.0 and s[5] == 0.5 and s[6] == 1.0


def test_torchaos_scale_is_our_exact_rule_bit_for_bit_from_1e_12_up():
    from torchao.float8.float8_utils import amax_to_scale

    from jetrl_compile.runtime.quantize import TORCHAO_MIN_AMAX, _exact_power_of_two_scale, _power_of_two_scale

    # every float32 in the two binades around 448 (where log2 rounding could land a power off),
    # each edge 448 * 2**k with its neighbours, and random magnitudes over the whole range
    binades = torch.arange(0x43800000, 0x44800000, dtype=torch.int32)  # 256.0 .. 1024.0.view(torch.float32)
    edges = (FP8_MAX * torch.exp2(torch.arange(-45, 121, dtype=torch.float64))).float()
    up, down = torch.nextafter(edges, torch.tensor(math.inf)), torch.nextafter(edges, torch.tensor(0.0))
    spread = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(math.log(1e-12), math.log(3e38))).float()
    amax = torch.cat([binades, edges, up, down, spread, torch.tensor([TORCHAO_MIN_AMAX, 3.4e38])])
    amax = amax[amax >= TORCHAO_MIN_AMAX]
    assert torch.equal(_power_of_two_scale(amax), _exact_power_of_two_scale(amax))
    # the one case torchao's own rounding gets wrong (one power too small: the group saturates)
    # and the quantizer corrects: amax one float32 ulp above 448 * 2**k
    torchao = 1.0 / amax_to_scale(up, FP8_DTYPE, round_scales_to_power_of_2=True)
    assert (up > FP8_MAX * torchao).any()
    assert torch.all(up <= FP8_MAX * _power_of_two_scale(up))


def test_below_torchaos_amax_floor_our_rule_holds():
    amax = torch.tensor([0.0, 1e-13, 1e-20, 1e-30, 1e-37])
    x = torch.zeros(len(amax), 128)
    x[:, 0] = amax
    q, s = quantize_groupwise(x)
    s = s.squeeze(-1)
    assert s[0] == 1.0  # a zero group keeps scale 1 (torchao's rule would give 2**-48)
    assert torch.all(amax[1:] <= FP8_MAX * s[1:])
    assert torch.all(amax[1:4] > FP8_MAX * s[1:4] / 2)  # the smallest power of two; 1e-37 hits 2**-126
    assert torch.all(q[1:4, 0].float() >= FP8_MAX / 2)  # tiny groups still use FP8's full range


def test_dequantized_values_are_exact_in_bf16():
    torch.manual_seed(2)
    w = torch.randn(300, 200)
    q, s = quantize_blockwise(w)
    as_fp32 = dequantize(q, s, torch.float32)
    assert torch.equal(as_fp32, dequantize(q, s, torch.bfloat16).float())


def test_zero_blocks_get_scale_one_and_zero_payload():
    w = torch.zeros(200, 300)
    w[150:, 250:] = 1.0  # only the last (partial) block is nonzero
    q, s = quantize_blockwise(w)
    assert s[0, 0] == 1.0 and s[0, 1] == 1.0 and s[1, 0] == 1.0
    assert torch.equal(q[:128].float(), torch.zeros(128, 300))
    assert torch.equal(dequantize(q, s, torch.float32), w)


def test_values_beyond_448_saturate():
    x = torch.tensor([1000.0, -1e6, 448.0, 465.0, -470.0, float("nan")])
    out = cast_saturated(x).float()
    assert torch.equal(out[:5], torch.tensor([448.0, -448.0, 448.0, 448.0, -448.0]))
    assert torch.isnan(out[5]), "NaN is not saturated into a finite value"


def test_blockwise_of_transpose_is_transpose_of_blockwise():
    torch.manual_seed(3)
    w = torch.randn(300, 200)
    q, s = quantize_blockwise(w)
    assert_same_quantization(quantize_blockwise(w.t()), (q.t(), s.t()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_poisons_only_its_own_group(bad):
    x = torch.randn(3, 300)
    x[1, 140] = bad  # group 1 of row 1
    deq = dequantize(*quantize_groupwise(x), torch.float32)
    assert torch.isnan(deq[1, 128:256]).all(), "the whole group dequantizes to NaN"
    assert torch.isfinite(deq[1, :128]).all() and torch.isfinite(deq[1, 256:]).all()
    assert torch.isfinite(deq[0]).all() and torch.isfinite(deq[2]).all()

    w = torch.randn(200, 300)
    w[130, 10] = bad  # block (1, 0)
    deq_w = dequantize(*quantize_blockwise(w), torch.float32)
    assert torch.isnan(deq_w[128:, :128]).all()
    assert torch.isfinite(deq_w[:128]).all() and torch.isfinite(deq_w[128:, 128:]).all()


def test_check_finite_flag_raises_with_the_shape(monkeypatch):
    monkeypatch.setenv("JETRL_CHECK_FINITE", "1")
    x = torch.ones(2, 130)
    x[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"shape \(2, 130\)"):
        quantize_groupwise(x)


def test_dequantize_rejects_mismatched_scale():
    q, _ = quantize_blockwise(torch.randn(200, 300))
    with pytest.raises(ValueError, match="fits neither"):
        dequantize(q, torch.ones(5, 5))


def test_partial_blocks_compiled_equal_eager():
    """docs/design.md, pitfall 1: a padded formulation compiled to a loop that skipped the tail columns."""
    torch.manual_seed(4)
    x = torch.randn(6, 200, dtype=torch.bfloat16) * 3
    w = torch.randn(200, 300)

    def both(x, w):
        return (*quantize_groupwise(x), *quantize_blockwise(w))

    eager = both(x, w)
    compiled = torch.compile(both, fullgraph=True, dynamic=False)(x, w)
    for e, c in zip(eager, compiled):
        assert e.dtype == c.dtype and e.shape == c.shape
        if e.dtype == FP8_DTYPE:
            e, c = e.view(torch.uint8), c.view(torch.uint8)
        assert torch.equal(e, c)


@pytest.mark.parametrize("shape", [(5, 576), (3, 1536), (2, 7, 96), (1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("along_tokens", [False, True])
def test_fused_fake_quantize_is_bitwise_the_eager_ops(shape, dtype, along_tokens):
    """The vLLM plugin and the eager trainer run the compiled kernel; the compiled trainer traces
    the plain ops. They must agree bit for bit, NaN groups included."""
    from jetrl_compile.runtime.quantize import _fake_quantize, fake_quantize_groupwise

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-30, 30, (*shape[:-1], 1), generator=g).float()
    x.view(-1, shape[-1])[0, :3] = 0.0
    x.view(-1, shape[-1])[-1, -1] = float("nan")
    x = x.to(dtype)
    fused, eager = fake_quantize_groupwise(x, along_tokens=along_tokens), _fake_quantize(x)
    assert fused.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(fused.isnan(), eager.isnan())
    assert torch.equal(fused.nan_to_num().view(torch.int16), eager.nan_to_num().view(torch.int16))


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_quantize_is_bitwise_quantize_groupwise(transposed):
    """The FP8 wgrad quantizes x^T (a non-contiguous view) through the fused kernel."""
    from jetrl_compile.runtime.quantize import fused_quantize_groupwise

    g = torch.Generator().manual_seed(7)
    x = (
        torch.randn(300, 200, generator=g) * 10.0 ** torch.randint(-20, 20, (300, 1), generator=g).float()
    ).to(torch.bfloat16)
    x = x.t() if transposed else x
    assert_same_quantization(fused_quantize_groupwise(x, along_tokens=transposed), quantize_groupwise(x))


def test_the_fused_quantize_compiles_once_per_group_length_and_once_for_any_token_count():
    """An activation's last dim is a linear's in- or out-features: its kernel is compiled for that
    length, with the rows (tokens) dynamic, so a new batch size compiles nothing (decode's single
    row, an empty batch, leading dims and a strided input included) and a new length compiles a
    graph of its own. The wgrad's operands have the token count as their last dim: with
    ``along_tokens`` their kernel is dynamic in it too. Every result is the eager ops' bit for bit."""
    from torch._dynamo.utils import counters

    from jetrl_compile.runtime import quantize
    from jetrl_compile.runtime.quantize import _fake_quantize, fake_quantize_groupwise, fused_quantize_groupwise

    def graphs(inputs, quantize_fn=fake_quantize_groupwise, **kw) -> int:
        before = counters["stats"]["unique_graphs"]
        for x in inputs:
            if quantize_fn is fake_quantize_groupwise:
                assert torch.equal(quantize_fn(x, **kw), _fake_quantize(x))
            else:
                assert_same_quantization(quantize_fn(x, **kw), quantize_groupwise(x))
            assert not hasattr(x, "_dynamo_unbacked_indices")  # the caller's tensor is never marked
        return counters["stats"]["unique_graphs"] - before

    g = torch.Generator().manual_seed(3)
    quantize._compiled.cache_clear()  # compiled variants of this test's own, counting their own graphs
    try:
        rows = [torch.randn(m, 331, generator=g) for m in (9, 40, 1, 0)]
        assert graphs(rows) == 1
        assert graphs([torch.randn(2, 5, 331, generator=g), torch.randn(331, 7, generator=g).t()]) == 0
        assert graphs([torch.randn(9, 339, generator=g)]) == 1  # same groups (2 full and a tail), another length
        assert graphs([torch.randn(m, 331, generator=g) for m in (3, 0)], fused_quantize_groupwise) == 1
        tokens = [torch.randn(33, t, generator=g) for t in (333, 461, 589)]  # 2+ full groups and a tail
        assert graphs(tokens[:1], along_tokens=True) == 1 and graphs(tokens[1:], along_tokens=True) == 0
    finally:
        quantize._compiled.cache_clear()


def test_fused_fake_quantize_still_raises_under_check_finite(monkeypatch):
    from jetrl_compile.runtime.quantize import fake_quantize_groupwise

    monkeypatch.setenv("JETRL_CHECK_FINITE", "1")
    with pytest.raises(FloatingPointError, match="quantize_groupwise"):
        fake_quantize_groupwise(torch.tensor([[1.0, float("inf")]]))


def test_fused_quantize_is_bitwise_in_avx2_code_too(tmp_path):
    """The fused kernels as Inductor compiles them for an AVX2-only CPU (forced through
    ATEN_CPU_CAPABILITY, whatever this CPU is): the eager trainer and the vLLM plugin run them on
    such CPUs. The kernel cache is the test's own: Inductor reuses a kernel compiled under another
    ATEN_CPU_CAPABILITY on the same machine, and that one gave wrong payloads and heap corruption."""
    import subprocess
    import sys

    script = """
import torch
from jetrl_compile.runtime.quantize import (
    _fake_quantize, fake_quantize_groupwise, fused_quantize_groupwise, quantize_groupwise,
)
from tests.conftest import assert_same_quantization
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
for dtype in (torch.bfloat16, torch.float32):
    for m, n in ((3, 128), (16, 300), (5, 576)):
        x = (torch.randn(m, n) * 10.0 ** torch.randint(-20, 20, (m, 1)).float()).to(dtype)
        assert_same_quantization(fused_quantize_groupwise(x), quantize_groupwise(x))
        assert torch.equal(fake_quantize_groupwise(x, torch.float32), _fake_quantize(x, torch.float32)), (m, n)
print("ok")
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
