"""Quantized weights, made once per optimizer step and shared by the trainer and the exporter.

Each entry is keyed by the parameter and stamped with its version counter (bumped by every
in-place update: optimizer steps, ``load_state_dict``, ``copy_``), its storage and its dtype; a
weight FSDP2 gathers from shards is stamped with its shard's version instead (``sharding``). A
lookup whose stamp no longer matches re-quantizes; otherwise every micro-batch, every compiled
graph and the vLLM exporter get the same (payload, scale) tensors, so rollout sees the bytes
training used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .fp8_all_gather import GatheredFP8Weight
from .invariant import FixedPoint
from .quantize import Quantized, dequantize, quantize_blockwise
from .sharding import ShardMap

_FIXED_KINDS = ("fp8", "bf16", "raw")


@dataclass
class _Entry:
    param: weakref.ref
    stamp: tuple
    quantized: Quantized
    dequantized: dict = field(default_factory=dict)  # dtype -> dequantize(*quantized, dtype)


def _quantization_of(param: torch.Tensor) -> Quantized:
    """``quantize_blockwise(param)``; for a weight FSDP2 gathered as FP8 blocks, a copy of the
    gathered ones (bitwise the same: ``fp8_all_gather``), since FSDP2 frees them after the forward."""
    if isinstance(param, GatheredFP8Weight):
        return Quantized(param.quantized.data.clone(), param.quantized.scale.clone())
    return quantize_blockwise(param.detach())


class WeightCache:
    """FP8 128 x 128 block quantizations of parameters, refreshed when a parameter changes."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.shards = ShardMap(model)  # FSDP2: a gathered weight's value comes from its shard
        self._entries: dict[int, _Entry] = {}
        self._fixed: dict[tuple[int, str], tuple[weakref.ref, tuple, FixedPoint]] = {}
        self.quantizations = 0  # how many times a weight was (re)quantized: for tests and logs

    def get(self, param: torch.Tensor) -> Quantized:
        """The current quantization of ``param`` (re-quantized only if it changed)."""
        return self._entry(param).quantized

    def get_dequantized(self, param: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``dequantize(*get(param), dtype)``, made once per quantization: the exact operand the
        emulated FP8 GEMM multiplies by (``dtype``: the GEMM path's operand dtype, BF16 or FP32),
        so decode does not dequantize every weight per token."""
        entry = self._entry(param)
        if dtype not in entry.dequantized:
            entry.dequantized[dtype] = dequantize(*entry.quantized, dtype)
        return entry.dequantized[dtype]

    def get_fixed(self, param: torch.Tensor, kind: str) -> FixedPoint:
        """The weight as exact mode's GEMM operand (``invariant.FixedPoint``), made once per
        version of ``param``: of its FP8 quantization dequantized (``"fp8"``), of its BF16 copy
        (``"bf16"``), both in 128-blocks, or of the parameter itself in one block per row
        (``"raw"``, for linears left unquantized)."""
        if kind not in _FIXED_KINDS:
            raise ValueError(f"fixed-point kind {kind!r} is unknown; choose one of {', '.join(_FIXED_KINDS)}")
        key, stamp = (id(param), kind), self._stamp(param)
        held = self._fixed.get(key)
        if held is None or held[0]() is not param or held[1] != stamp:
            with torch.no_grad():
                if kind == "fp8":
                    fixed = FixedPoint(dequantize(*self.get(param), torch.float32))
                elif kind == "bf16":
                    fixed = FixedPoint(param.detach().to(torch.bfloat16))
                else:
                    fixed = FixedPoint(param.detach(), block=None)
                held = (weakref.ref(param), stamp, fixed)
            self._fixed[key] = held
        return held[2]

    def _entry(self, param: torch.Tensor) -> _Entry:
        entry = self._entries.get(id(param))
        stamp = self._stamp(param)
        if entry is None or entry.param() is not param or entry.stamp != stamp:
            with torch.no_grad():
                quantized = _quantization_of(param)
            entry = _Entry(weakref.ref(param), stamp, quantized)
            self._entries[id(param)] = entry
            self.quantizations += 1
        return entry

    def _stamp(self, param: torch.Tensor) -> tuple:
        """What changes when ``param``'s value may have: its version and storage, or, for a weight
        FSDP2 gathered, its shard's (``runtime.sharding``); and the dtype, device and shape."""
        shard = self.shards.shard_of(param)
        source = (shard._version, id(shard)) if shard is not None else (param._version, param.data_ptr())
        return (*source, param.dtype, param.device, tuple(param.shape))

    def nbytes(self) -> int:
        """Bytes held: FP8 payloads, float32 scales, dequantized copies and exact-mode operands."""
        return sum(
            e.quantized.data.nbytes + e.quantized.scale.nbytes + sum(d.nbytes for d in e.dequantized.values())
            for e in self._entries.values()
        ) + sum(fixed.nbytes for _, _, fixed in self._fixed.values())

    def clear(self) -> None:
        self._entries.clear()
        self._fixed.clear()

    def __len__(self) -> int:
        return len(self._entries)
