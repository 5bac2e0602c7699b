"""The weight cache quantizes a parameter once per version and hands every caller the same bytes."""

import torch

from jetrl_compile.runtime import dequantize, quantize_blockwise
from jetrl_compile.runtime.weight_cache import WeightCache
from tests.conftest import assert_same_quantization


def test_one_quantization_per_parameter_version_shared_by_every_caller():
    w = torch.nn.Parameter(torch.randn(200, 300))
    cache = WeightCache()
    first = cache.get(w)
    assert cache.get(w) is first and cache.quantizations == 1  # the same tensors, not a copy
    assert_same_quantization(first, quantize_blockwise(w.detach()))
    with torch.no_grad():
        w.mul_(2)  # an optimizer step: the version counter moves
    second = cache.get(w)
    assert cache.quantizations == 2 and second is not first
    assert torch.equal(second.scale, first.scale * 2)


def test_dequantized_copies_per_dtype_made_once_and_dropped_with_a_new_version():
    w = torch.nn.Parameter(torch.randn(130, 129))
    cache = WeightCache()
    bf16 = cache.get_dequantized(w, torch.bfloat16)
    fp32 = cache.get_dequantized(w, torch.float32)
    assert cache.get_dequantized(w, torch.bfloat16) is bf16
    assert torch.equal(bf16.float(), fp32)  # exact in both dtypes
    assert torch.equal(fp32, dequantize(*cache.get(w), torch.float32))
    q = cache.get(w)
    assert cache.nbytes() == q.data.nbytes + q.scale.nbytes + bf16.nbytes + fp32.nbytes
    with torch.no_grad():
        w.add_(1)
    assert cache.get_dequantized(w, torch.bfloat16) is not bf16


def test_load_state_dict_and_a_new_parameter_refresh_and_clear_empties():
    model = torch.nn.Linear(300, 200)
    cache = WeightCache()
    cache.get(model.weight)
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    assert_same_quantization(cache.get(model.weight), quantize_blockwise(model.weight.detach()))
    other = torch.nn.Parameter(model.weight.detach().clone())
    cache.get(other)
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes() == 0
