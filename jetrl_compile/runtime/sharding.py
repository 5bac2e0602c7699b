"""Which parameter a weight's value comes from when FSDP2 shards the model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a shard (a DTensor the
optimizer updates) and, before a module runs, all-gathers the shards into an unsharded parameter
that the module's forward reads. That unsharded parameter is the same object every step, and
FSDP2 refills it without bumping its version counter (the refill must not invalidate the copy
autograd saved for backward), often into the same memory. So its version, storage and dtype say
nothing about whether the weight changed: a cache keyed on them would keep serving the first
step's quantization. The shard does say it: every optimizer step, ``load_state_dict`` or
``copy_`` on it bumps its version. ``ShardMap`` finds the shard behind an unsharded parameter;
``gathered(model)`` makes every parameter whole for a reader outside the forward (the exporter).

Written for torch 2.13's FSDP2, whose parameter bookkeeping (``FSDPParam``) is not public API:
``ShardMap`` reads it in one place and names the torch it was written for when it is missing.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
import torch.nn as nn

WRITTEN_FOR_TORCH = "2.13"


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s FSDP2-sharded modules (none unless FSDP2 is in use)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # nothing imported FSDP2, so nothing in this process is sharded by it
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def _bookkeeping(read):
    """``read()`` of FSDP2's per-module bookkeeping (param groups, their ``FSDPParam`` records and
    all-gathers), which is not public API: a torch without it is named here, in one place."""
    try:
        return read()
    except AttributeError as e:
        raise RuntimeError(
            f"jetrl_compile reads FSDP2's parameter bookkeeping (to know when a sharded weight changed, and to "
            f"count all-gathers); this torch ({torch.__version__}) lacks {e.name!r} (written for torch "
            f"{WRITTEN_FOR_TORCH}): pin torch {WRITTEN_FOR_TORCH} or report the torch version"
        ) from e


def _param_groups(module: nn.Module) -> list:
    return _bookkeeping(lambda: list(module._get_fsdp_state()._fsdp_param_groups))


def _fsdp_params(model: nn.Module):
    """Every FSDP2 ``FSDPParam`` of ``model``'s modules."""
    for module in _fsdp_modules(model):
        yield from _bookkeeping(lambda module=module: [p for g in _param_groups(module) for p in g.fsdp_params])


class ShardMap:
    """``shard_of(param)``: the FSDP2 shard an unsharded parameter of ``model`` is gathered
    from, or ``None`` for a parameter FSDP2 does not manage (then the parameter is its own source).

    The map is rebuilt when a parameter object is met for the first time: FSDP2 creates each
    unsharded parameter at its first all-gather and keeps it after, so a module sharded after
    ``unify`` (or before) is found at the first lookup of its weights. The shard is read from
    FSDP2's record at each lookup, so a shard FSDP2 replaces is followed."""

    def __init__(self, model: nn.Module | None = None):
        self._model = weakref.ref(model) if model is not None else None
        self._params: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(unsharded) -> (unsharded, FSDPParam)
        self._seen: dict[int, weakref.ref] = {}  # id(parameter) -> the parameter, once looked up

    def shard_of(self, param: torch.Tensor) -> torch.Tensor | None:
        if self._model is None:
            return None
        seen = self._seen.get(id(param))
        if seen is None or seen() is not param:  # a new object (or a new one at a reused id)
            self._rebuild()
            self._seen[id(param)] = weakref.ref(param)
        held = self._params.get(id(param))
        record = held[1]() if held is not None and held[0]() is param else None
        return record.sharded_param if record is not None else None

    def _rebuild(self) -> None:
        model = self._model() if self._model is not None else None
        if model is None:
            return
        self._params = {
            id(p._unsharded_param): (weakref.ref(p._unsharded_param), weakref.ref(p))
            for p in _fsdp_params(model)
            if hasattr(p, "_unsharded_param")
        }


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards a module of ``model``: then every forward is a collective, and ranks
    that run it must run it alike (as many times, in the same order)."""
    return bool(_fsdp_modules(model))


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Within this block every FSDP2-sharded module of ``model`` holds its unsharded parameters,
    as during its forward (for reading all weights, e.g. to export them to the engine); on exit
    they are sharded again. A collective: every rank must enter it. A no-op without FSDP2.
    Yields whether anything was gathered (FSDP2 frees the gathered weights on exit)."""
    modules = _fsdp_modules(model)
    for module in modules:
        module.unshard()
    try:
        yield bool(modules)
    finally:
        for module in modules:
            module.reshard()


class GatherLog:
    """What FSDP2 all-gathered while ``count_all_gathers`` was on: one ``(module, bytes)`` per
    all-gather, ``bytes`` being what the rank received (every rank's input, its own included)."""

    def __init__(self):
        self.calls: list[tuple[nn.Module, int]] = []

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.calls)


@contextlib.contextmanager
def count_all_gathers(model: nn.Module):
    """Within this block, record the bytes of every all-gather FSDP2 runs for ``model``'s sharded
    modules; yields the ``GatherLog``. Each param group's all-gather (FSDP2's default, or what
    ``set_custom_all_gather`` installed) is wrapped in a counter and put back on exit; the groups
    are FSDP2 bookkeeping (``_bookkeeping``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    log = GatherLog()

    class Counting(AllGather):
        def __init__(self, module, inner):
            self.module, self.inner = module, inner

        def allocate(self, *args, **kwargs):
            return self.inner.allocate(*args, **kwargs)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            log.calls.append((self.module, output_tensor.nbytes))
            return self.inner(output_tensor, input_tensor, group, async_op)

    groups = [(module, group) for module in _fsdp_modules(model) for group in _param_groups(module)]
    before = [_bookkeeping(lambda group=group: group._all_gather_comm) for _, group in groups]
    for (module, group), inner in zip(groups, before):
        group._all_gather_comm = Counting(module, inner)
    try:
        yield log
    finally:
        for (_, group), inner in zip(groups, before):
            group._all_gather_comm = inner
