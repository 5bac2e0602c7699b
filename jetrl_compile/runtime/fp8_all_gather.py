"""FSDP2 all-gathers of FP8 weight blocks instead of the full-precision weight.

FSDP2 gathers every sharded parameter before its module runs, once for the forward and, with
``reshard_after_forward`` (its default), again for the backward. For a linear whose every GEMM
reads the weight only through its FP8 128 x 128 blocks (the ``jetrl`` recipe: FP8 fprop and FP8
dgrad; wgrad does not read the weight), the full-precision weight is never needed whole: each rank
can quantize its own shard and gather the FP8 payload plus the block scales, 1/4 of an FP32
gather (1/2 of BF16), plus 4 bytes per 16,384 weights of scales.

That is bitwise the quantization of the whole weight when every shard holds whole 128-row blocks:
FSDP2 shards a weight's rows evenly (``N / world`` rows per rank), and the blocks of a shard are
then blocks of the weight, with the same amax and so the same scale and payload. Where the shard
boundary falls inside a block (SmolLM2's 576 rows over 2 ranks = 288, two blocks and a quarter),
a block's amax would span two ranks; those weights gather in full precision, as before, and the
weight cache quantizes the gathered weight (docs/design.md, section 5.3, says why not pad).

FSDP2's extension point is a tensor subclass on the shard with ``fsdp_pre_all_gather`` (what to
send) and ``fsdp_post_all_gather`` (what the module reads). ``ShardWithFP8Gather`` wraps the
master shard: the optimizer and checkpoints see its full-precision values, unchanged. The
module reads a ``GatheredFP8Weight``: the weight's shape and dtype, holding the gathered payload
and scales, which ``WeightCache`` hands to the recipe op. Anything else that tries to read its
values fails loudly (it has none). Eager mode only for now: Dynamo would trace the subclasses.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .format import GROUP
from .quantize import Quantized, quantize_blockwise

_aten = torch.ops.aten

# ops whose result is (a view or copy of) the shard itself: they keep the wrapper, so FSDP2's
# chunking, padding and copy-in at fully_shard time produce a wrapped shard
_SHARD_PRESERVING = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.narrow.default,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten.split.Tensor,
    _aten.clone.default,
}


class ShardWithFP8Gather(torch.Tensor):
    """A weight's master shard (``.shard``, full precision) that FSDP2 all-gathers as FP8 blocks.

    Every op but the all-gather runs on the shard itself (optimizer steps, ``copy_`` from a
    checkpoint, state dicts), so training state is what it would be without the wrapper."""

    shard: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shard: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, shard.size(), strides=shard.stride(), storage_offset=shard.storage_offset(), dtype=shard.dtype,
            layout=shard.layout, device=shard.device, requires_grad=shard.requires_grad,
        )

    def __init__(self, shard: torch.Tensor):
        self.shard = shard

    def __repr__(self):
        return f"ShardWithFP8Gather({self.shard!r})"

    def __reduce_ex__(self, protocol):
        # saved (torch.save, a sharded checkpoint's local tensor) as the plain shard it wraps
        return self.shard.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["shard"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ShardWithFP8Gather(inner["shard"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(ShardWithFP8Gather, lambda t: t.shard, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_PRESERVING:
            return out
        return pytree.tree_map_only(torch.Tensor, ShardWithFP8Gather, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What this rank sends: its shard's FP8 payload and block scales."""
        if self.shard.shape[0] % GROUP:
            raise RuntimeError(
                f"FP8 all-gather: this rank's shard of a weight of {tuple(outer_size)} holds {self.shard.shape[0]} "
                f"rows, which cuts a 128-row block. jetrl_compile.fp8_all_gather planned for another number of "
                f"ranks than FSDP2 shards over ({mesh.size()} here): pass world_size= the size of the shard group"
            )
        with torch.no_grad():
            q, s = quantize_blockwise(self.shard)
        return (q, s), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """What the module reads: the gathered payload and scales in the weight's shape and dtype.
        On later gathers FSDP2 refills the same buffers in place, so ``out`` needs nothing."""
        q, s = outputs
        if out is not None:
            return None
        return GatheredFP8Weight(Quantized(q, s), param_dtype), (q, s)


class GatheredFP8Weight(torch.Tensor):
    """A whole weight as FSDP2 gathered it in FP8: shape and dtype of the weight, values only as
    ``.quantized`` (payload, scales), which is bitwise ``quantize_blockwise`` of the whole weight."""

    quantized: Quantized
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, quantized: Quantized, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, quantized.data.shape, dtype=dtype, device=quantized.data.device, requires_grad=requires_grad,
        )

    def __init__(self, quantized: Quantized, dtype: torch.dtype, requires_grad: bool = False):
        self.quantized = quantized

    def __repr__(self):
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, gathered as FP8 blocks)"

    def __tensor_flatten__(self):
        return ["quantized_data", "quantized_scale"], self.dtype

    @property
    def quantized_data(self):
        return self.quantized.data

    @property
    def quantized_scale(self):
        return self.quantized.scale

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFP8Weight(Quantized(inner["quantized_data"], inner["quantized_scale"]), dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0] if args else None
        views_itself = func in (_aten.detach.default, _aten.alias.default) or (
            func is _aten.as_strided.default and tuple(args[1]) == tuple(self.shape)
        )
        if isinstance(self, GatheredFP8Weight) and views_itself:
            return GatheredFP8Weight(self.quantized, self.dtype)
        raise RuntimeError(
            f"{func} on a weight FSDP2 all-gathered as FP8 blocks: it holds no full-precision values, only "
            "what the recipe op reads (its payload and scales); run it through unify's linear, or shard "
            "without jetrl_compile.fp8_all_gather"
        )


def fp8_gather_plan(model: torch.nn.Module, recipe, world_size: int) -> dict[str, str | None]:
    """For each linear ``recipe`` rewrites: ``None`` if its weight can be all-gathered as FP8 blocks
    over ``world_size`` ranks, else why not."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plan = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or recipe.skip_reason(name) is not None:
            continue
        rows = module.weight.shape[0]
        tied = [n for n in names[id(module.weight)] if n != f"{name}.weight"]
        if tied:  # a new parameter for one of them would untie them
            plan[name] = f"its weight is tied to {tied[0]}"
        elif world_size == 1:  # FSDP2 then reads the shard in place, through no all-gather extension
            plan[name] = "one rank: FSDP2 gathers nothing"
        elif rows % world_size or (rows // world_size) % GROUP:
            plan[name] = (
                f"{rows} rows over {world_size} ranks: a shard of {rows / world_size:g} rows cuts a 128-row block"
            )
        else:
            plan[name] = None
    return plan


def enable_fp8_all_gather(model: torch.nn.Module, plan: dict[str, str | None]) -> None:
    """Wrap the weight of every linear ``plan`` allows (value ``None``) in ``ShardWithFP8Gather``,
    before ``fully_shard`` shards it."""
    for name, why_not in plan.items():
        if why_not is None:
            module = model.get_submodule(name)
            w = module.weight
            if not isinstance(w.data, ShardWithFP8Gather):
                module.weight = torch.nn.Parameter(ShardWithFP8Gather(w.data), requires_grad=w.requires_grad)


def unwrap_fp8_gather(state_dict: dict) -> dict:
    """``state_dict`` with each ``ShardWithFP8Gather`` replaced by the full-precision tensor it
    wraps (a full state dict of one rank holds the wrapper itself; of several, plain tensors)."""
    return {k: v.shard if isinstance(v, ShardWithFP8Gather) else v for k, v in state_dict.items()}
