"""The FSDP2 FP8 all-gather pieces, without a process group: what each rank would send, what the
module would read, and which weights qualify (the 2-process test is in tests/test_distributed.py)."""

import pytest
import torch

from jetrl_compile.recipes import get_recipe
from jetrl_compile.runtime.fp8_all_gather import (
    GatheredFP8Weight,
    ShardWithFP8Gather,
    fp8_gather_plan,
    unwrap_fp8_gather,
)
from jetrl_compile.runtime.quantize import quantize_blockwise
from tests.conftest import FSDP_ALIGNED, assert_same_quantization, tiny_model


def _weight(rows, cols=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so a block's amax depends on which rows it holds
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows).unsqueeze(1)


def _gather(weight, world):
    """What FSDP2 would hand the module: each rank's (payload, scales), concatenated by rows."""
    sent = [ShardWithFP8Gather(shard).fsdp_pre_all_gather(None, None, None, None, None)[0]
            for shard in weight.chunk(world)]
    outputs = tuple(torch.cat(parts) for parts in zip(*sent))
    gathered, inner = ShardWithFP8Gather(weight.chunk(world)[0]).fsdp_post_all_gather(outputs, None, weight.dtype)
    return gathered, inner


@pytest.mark.parametrize(("rows", "world"), [(256, 2), (512, 4), (384, 3), (1536, 2)])
def test_gathered_blocks_of_aligned_shards_are_the_whole_weights_quantization(rows, world):
    weight = _weight(rows)
    gathered, inner = _gather(weight, world)
    assert isinstance(gathered, GatheredFP8Weight)
    assert gathered.shape == weight.shape and gathered.dtype == weight.dtype
    assert_same_quantization(gathered.quantized, quantize_blockwise(weight))
    assert inner[0] is gathered.quantized.data and inner[1] is gathered.quantized.scale  # FSDP2 refills these


def test_a_shard_that_cuts_a_block_is_refused_and_would_quantize_differently():
    """576 rows over 2 ranks (SmolLM2): 288-row shards; the block holding rows 256..383 would take
    its scale from half of its rows on each rank, so the concatenation is not the whole weight's."""
    weight = _weight(576)
    halves = [quantize_blockwise(half) for half in weight.chunk(2)]
    whole = quantize_blockwise(weight)
    assert not torch.equal(torch.cat([h.data for h in halves]).view(torch.uint8), whole.data.view(torch.uint8))
    with pytest.raises(RuntimeError, match="holds 288 rows, which cuts a 128-row block.*pass world_size="):
        ShardWithFP8Gather(weight.chunk(2)[0]).fsdp_pre_all_gather(_Mesh(2), weight.shape, None, None, None)


class _Mesh:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_the_plan_gathers_fp8_only_where_shards_hold_whole_blocks():
    model = tiny_model(layers=1, **FSDP_ALIGNED)  # q/o 256 rows, k/v 64, MLP 512 and 256
    plan = fp8_gather_plan(model, get_recipe("jetrl"), 2)
    assert "lm_head" not in plan  # never quantized, so never a candidate
    fp8 = {n.rsplit(".", 1)[1] for n, why_not in plan.items() if why_not is None}
    assert fp8 == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert plan["model.layers.0.self_attn.k_proj"] == (
        "64 rows over 2 ranks: a shard of 32 rows cuts a 128-row block"
    )
    four = fp8_gather_plan(model, get_recipe("jetrl"), 4)  # only gate/up (512 rows) give 128-row shards
    assert sorted(n for n, why_not in four.items() if why_not is None) == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert set(fp8_gather_plan(model, get_recipe("jetrl"), 1).values()) == {"one rank: FSDP2 gathers nothing"}


def test_tied_weights_are_never_wrapped():
    """Wrapping one of two tied parameters would untie them: a tied lm_head stays in full precision."""
    model = tiny_model(layers=1, tie_word_embeddings=True, **FSDP_ALIGNED)
    plan = fp8_gather_plan(model, get_recipe("jetrl").with_options(include_lm_head=True), 2)
    assert plan["lm_head"] == "its weight is tied to model.embed_tokens.weight"


def test_a_saved_wrapped_shard_loads_as_the_plain_shard(tmp_path):
    """``torch.save`` of a wrapped shard (a one-rank state dict, a sharded checkpoint's local
    tensor) writes the plain tensor, which ``torch.load(weights_only=True)`` reads."""
    torch.save({"w": ShardWithFP8Gather(_weight(256))}, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, _weight(256))


def test_the_wrapped_shard_trains_as_the_shard_and_checkpoints_its_values():
    """Optimizer steps run on the wrapped full-precision shard: bitwise a plain parameter's."""
    plain = torch.nn.Parameter(_weight(256))
    wrapped = torch.nn.Parameter(ShardWithFP8Gather(_weight(256)))
    for p in (plain, wrapped):
        opt = torch.optim.AdamW([p], lr=1e-2)
        for step in range(3):
            p.grad = torch.full_like(plain, 0.1 * (step + 1))
            opt.step()
    assert isinstance(wrapped.data, ShardWithFP8Gather)
    moved = unwrap_fp8_gather({"w": wrapped.data})["w"]
    assert type(moved) is torch.Tensor and not torch.equal(moved, _weight(256))
    assert torch.equal(moved, plain.detach())


def test_a_gathered_weight_refuses_to_be_read_as_values():
    gathered, _ = _gather(_weight(256), 2)
    assert isinstance(gathered.detach(), GatheredFP8Weight)
    with pytest.raises(RuntimeError, match="all-gathered as FP8 blocks"):
        gathered + 1
    with pytest.raises(RuntimeError, match="all-gathered as FP8 blocks"):
        torch.nn.functional.linear(torch.ones(1, 320), gathered)


def test_the_weight_cache_serves_a_copy_of_the_gathered_blocks():
    """FSDP2 frees its gather buffers when the layer reshards: the cache keeps its own copy."""
    from jetrl_compile.runtime.weight_cache import WeightCache

    weight = _weight(256)
    gathered, (q, s) = _gather(weight, 2)
    cache = WeightCache()
    got = cache.get(gathered)
    assert_same_quantization(got, quantize_blockwise(weight))
    assert got.data.data_ptr() != q.data_ptr() and got.scale.data_ptr() != s.data_ptr()
    assert cache.get(gathered) is got and cache.quantizations == 1
