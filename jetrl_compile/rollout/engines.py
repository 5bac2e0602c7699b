"""Rollout engines: sample completions with the logprob of every sampled token, and take the
trainer's new weights after each optimizer step.

``VllmEngine`` owns a colocated vLLM ``LLM`` (in this process by default, or with its engine core
in a process of its own) that loads ``export_vllm``'s checkpoint (our ``jetrl`` quantization
method runs the trainer's linear op) and ``sync``s by pushing the trainer's cached (payload,
scale) pairs into the running model in place (``LLM.collective_rpc("reload_weights")``); for a trainer in exact
mode it makes the whole vLLM model exact (``vllm_exact``). ``HfEngine`` samples
with transformers' ``generate`` on the unified model itself, for machines without vLLM. Both
have the same interface; ``make_engine`` picks one.

Logprobs are "raw" by default: ``log_softmax`` of the model's logits before temperature or other
sampling processors, which is what our trainer recomputes (TRL recomputes them after temperature:
``VllmEngine(logprobs_mode="processed_logprobs")``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..exact import is_exact, logprobs_of
from ..recipes import Recipe
from ..runtime.fp8_linear import INDUCTOR_OPTIONS
from ..runtime.sharding import is_sharded
from ..state import is_unified
from ..unify import rollout_forward
from . import _vllm_compat
from .export import (
    engine_dtype,
    export_vllm,
    rollout_recipe_and_cache,
    rollout_tensors,
    validate_export,
    write_weights,
)


@dataclass
class Completion:
    """One sampled completion: its tokens (ending with EOS if it stopped) and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length"


class RolloutEngine:
    """The interface of both engines."""

    name: str
    recipe: Recipe

    def generate(
        self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids), deterministic for a given ``seed`` and weights."""
        raise NotImplementedError

    def sync(self, model: nn.Module) -> float:
        """Make the engine sample from ``model``'s current weights; returns the seconds it took."""
        raise NotImplementedError

    def close(self) -> None:
        pass


# the vLLM logprobs an engine reports: before any sampling processor, or after temperature
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# vLLM reserves KV cache for a whole context: the model's, capped here (a rollout needs far less)
MAX_MODEL_LEN = 2048
# the KV cache of an engine on the CPU, in GiB (VLLM_CPU_KVCACHE_SPACE)
CPU_KV_CACHE_GIB = 1


def default_max_model_len(max_position_embeddings: int | None) -> int:
    """The context an engine is started with: the model's, at most ``MAX_MODEL_LEN``."""
    return min(int(max_position_embeddings or MAX_MODEL_LEN), MAX_MODEL_LEN)


def vllm_available() -> bool:
    """Whether vLLM is installed. Not whether it imports: an install that is present but broken
    (e.g. CUDA torchvision on a CPU machine) must fail loudly with its import error when an engine
    starts, not turn ``engine="auto"`` into a silent fallback."""
    return importlib.util.find_spec("vllm") is not None


def make_engine(model: nn.Module, engine: str = "auto", **kwargs) -> RolloutEngine:
    """``engine="vllm"``, ``"hf"``, or ``"auto"`` (vLLM when installed, else transformers)."""
    if engine == "auto":
        engine = "vllm" if vllm_available() else "hf"
    if engine == "vllm":
        return VllmEngine(model, **kwargs)
    if engine == "hf":
        kwargs = {k: v for k, v in kwargs.items() if k in ("eos_token_id", "pad_token_id", "tokenizer")}
        return HfEngine(model, **kwargs)
    raise ValueError(f"rollout engine {engine!r} is unknown; choose vllm, hf or auto")


def _tensor_signature(model: nn.Module) -> dict[str, tuple]:
    return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


def memory_share(gpu_memory: float) -> dict:
    """vLLM's memory setting for a colocated engine: ``gpu_memory_utilization`` on a GPU (vLLM's
    own default, 0.9, would leave the trainer a tenth), nothing on the CPU, whose KV cache
    ``VLLM_CPU_KVCACHE_SPACE`` sizes."""
    if not 0.0 < gpu_memory <= 1.0:
        raise ValueError(f"gpu_memory={gpu_memory} is a share of the GPU's memory: 0 < share <= 1")
    return {"gpu_memory_utilization": gpu_memory} if torch.cuda.is_available() else {}


def _default_group_size() -> int:
    """Processes in torch.distributed's default process group; 0 where there is none."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


class VllmEngine(RolloutEngine):
    """In-process vLLM on the trainer's exported rollout weights."""

    name = "vllm"

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer=None,
        recipe: str | Recipe | None = None,
        workdir: str | Path | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 16384,
        kv_cache_gib: int = CPU_KV_CACHE_GIB,
        gpu_memory: float = 0.3,
        enforce_eager: bool = True,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        in_process: bool = True,
        logprobs_mode: str = "raw_logprobs",
    ):
        """``in_process=False`` runs vLLM's engine core in its own process (what ``vllm serve``
        does); ``sync`` then rewrites the export's weights file and has the worker reload it, and
        exact mode and ``worker``/``vllm_model`` (which reach into the model) are not available.
        ``logprobs_mode="processed_logprobs"`` reports logprobs after temperature (what TRL
        recomputes) instead of the raw ones our trainer recomputes.

        Memory: on a GPU, vLLM may take ``gpu_memory`` of the device's memory (its
        ``gpu_memory_utilization``: weights, activations and KV cache; the colocated trainer keeps
        the rest); on the CPU its KV cache is ``kv_cache_gib``.

        ``enforce_eager=False`` is vLLM's compiled model: vLLM traces its model with our op inside
        (one graph, no break) and Inductor compiles it, told to round to BF16 where the op does
        (``INDUCTOR_OPTIONS``), so every FP8 code is the eager engine's. vLLM's other ops then
        run as Inductor code instead of vLLM's CPU kernels, which moves logprobs by float32 ulps:
        close to the eager engine, not bitwise (docs/design.md section 4). Exact mode needs the eager
        engine (it patches the model vLLM runs, after the compiled one was traced).

        Inside a torch.distributed world of more than one process (torchrun, data parallel), the
        engine joins that world as vLLM's ``external_launcher``: one independent engine per rank,
        each sampling its own prompts from its rank's weights (tensor parallel 1), in-process.
        Starting one is then a collective (vLLM makes its groups and agrees on the KV-cache size
        across the world): every rank builds its engine at the same point, and closes it."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r} is unknown; choose one of {', '.join(LOGPROBS_MODES)}")
        self.recipe, _ = rollout_recipe_and_cache(model, recipe)
        self.in_process = in_process
        self._recipe_arg = recipe
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="jetrl-rollout-"))
        self.eos_token_id = (
            eos_token_id if eos_token_id is not None else _first(getattr(model.config, "eos_token_id", None))
        )
        if max_model_len is None:  # the model's context, capped: vLLM reserves KV cache for it
            max_model_len = default_max_model_len(getattr(model.config, "max_position_embeddings", None))
        self.dtype = engine_dtype(model, dtype)
        self.exact = is_exact(model)
        if self.exact and not in_process:
            raise ValueError("exact mode patches vLLM's model in this process: drop in_process=False")
        # a default process group that exists now is the caller's: vLLM must leave it standing
        world = _default_group_size()
        self._callers_group = world > 0
        joins_world = world > 1
        if joins_world and not in_process:
            raise ValueError(
                "in a torch.distributed world each rank's engine joins it in-process (vLLM's "
                "external_launcher): drop in_process=False"
            )
        if self.exact and not enforce_eager:
            raise ValueError(
                "exact mode patches vLLM's eager model; a compiled engine would keep running the graph "
                "it traced before the patches: drop enforce_eager=False"
            )
        if self.exact and self.dtype != next(model.parameters()).dtype:
            raise ValueError(
                f"exact mode runs the engine in the trainer's dtype ({next(model.parameters()).dtype}), "
                f"not {self.dtype}: drop dtype= or pass the model's"
            )
        self.export_dir = export_vllm(
            model, self.workdir / "rollout-weights", tokenizer=tokenizer if tokenizer is not None else False,
            recipe=recipe, dtype=self.dtype
        )
        validate_export(self.export_dir)
        self._signature = _tensor_signature(model)
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)

        from vllm import LLM

        # where the engine core runs, this engine's cache folder and KV size: set while vLLM
        # starts, then the caller's environment is back for the next engine
        settings = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
            "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache"),
            "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        }
        engine_args = {}
        if self.exact and torch.cuda.is_available():  # a KV cache ExactAttention reads (vllm_exact.KV_SPLITS)
            from .vllm_exact import GPU_ATTENTION_BACKEND

            engine_args["attention_backend"] = GPU_ATTENTION_BACKEND
        if joins_world:  # vLLM makes its groups inside the trainer's world instead of its own
            settings.update(_vllm_compat.external_launcher_settings(torch.distributed.get_rank()))
            engine_args["distributed_executor_backend"] = "external_launcher"
        _vllm_compat.share_model_info_cache(self.workdir / "vllm-cache")
        self._dynamo_hooks: set[int] = set()  # a compiled model's; close removes them
        with _vllm_compat.environment(settings), _vllm_compat.dynamo_bytecode_hooks_added(self._dynamo_hooks):
            self.llm = LLM(
                model=str(self.export_dir),
                skip_tokenizer_init=tokenizer is None,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=enforce_eager,
                compilation_config=None if enforce_eager else {"inductor_compile_config": dict(INDUCTOR_OPTIONS)},
                max_model_len=max_model_len,
                max_num_batched_tokens=self.max_num_batched_tokens,
                seed=seed,
                logprobs_mode=logprobs_mode,
                use_tqdm_on_load=False,  # the export this engine just wrote: a bar per start says nothing
                **engine_args,
                **memory_share(gpu_memory),
            )
        self._exact = None
        if self.exact:  # before any request: the model computes exact mode's function from the start
            from ..exact import rope_table
            from .vllm_exact import make_exact

            self._exact = make_exact(self.llm, *rope_table(model))

    @property
    def worker(self):
        """vLLM's in-process worker (the object with ``reload_weights`` and the model)."""
        self._needs_in_process("worker")
        return _vllm_compat.worker(self.llm)

    @property
    def vllm_model(self) -> nn.Module:
        self._needs_in_process("vllm_model")
        return _vllm_compat.model(self.llm)

    def _needs_in_process(self, what: str) -> None:
        if not self.in_process:
            raise RuntimeError(f"VllmEngine.{what}: the model lives in vLLM's engine process (in_process=False)")

    def generate(self, prompts, *, n=1, max_new_tokens=64, temperature=1.0, seed=0):
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n, max_tokens=max_new_tokens, temperature=temperature, logprobs=0, seed=seed + i,
                detokenize=False, stop_token_ids=[] if self.eos_token_id is None else [self.eos_token_id],
            )
            for i in range(len(prompts))
        ]
        outputs = []
        for chunk in self._prefill_chunks(prompts, n):
            outputs += self.llm.generate(
                [{"prompt_token_ids": list(prompts[i])} for i in chunk], [params[i] for i in chunk], use_tqdm=False
            )
        result = []
        for out in outputs:
            group = []
            for o in out.outputs:
                lps = [step[tok].logprob for tok, step in zip(o.token_ids, o.logprobs)]
                group.append(Completion(list(o.token_ids), lps, "stop" if o.finish_reason == "stop" else "length"))
            result.append(group)
        return result

    def _prefill_chunks(self, prompts, n: int) -> list[list[int]]:
        """Prompt indices split so that each ``generate`` call prefills in one scheduler step.
        vLLM 0.32 on CPU crashes when a seeded request's prefill is split across steps
        (``CPU Generator does not use offset``); per-request seeds keep the samples independent
        of how requests are grouped, so splitting changes nothing else."""
        chunks, current, tokens = [], [], 0
        for i, p in enumerate(prompts):
            cost = len(p) * n
            if cost > self.max_num_batched_tokens:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) x n={n} exceeds max_num_batched_tokens="
                    f"{self.max_num_batched_tokens}; raise it or lower the group size"
                )
            if current and tokens + cost > self.max_num_batched_tokens:
                chunks.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += cost
        return chunks + ([current] if current else [])

    def sync(self, model: nn.Module) -> float:
        """Push the trainer's current rollout weights (all shards and scales of every layer
        together) into the running engine, in place, and repack what vLLM's CPU GEMMs multiply
        from them; then drop cached prefixes. The engine then computes what a fresh engine
        started from the same weights would, bit for bit."""
        signature = _tensor_signature(model)
        if signature != self._signature:
            diff = sorted(set(signature.items()) ^ set(self._signature.items()))[:3]
            raise ValueError(
                f"sync refused: the model's parameters differ from the ones this engine was built for "
                f"(first differences: {diff}); build a new engine for another architecture"
            )
        start = time.perf_counter()
        tensors = list(rollout_tensors(model, self._recipe_arg, dtype=self.dtype))
        if self.in_process:
            _vllm_compat.reload_weights(self.llm, tensors)
        else:  # the engine's process reads the new weights from the export folder it loaded
            write_weights(self.export_dir, tensors)
            _vllm_compat.reload_weights(self.llm, folder=self.export_dir)
        if self.in_process:  # a tied LM head's packed copy, which the reload leaves stale (vLLM's RPC
            # serializer cannot carry the function to an engine in its own process: not repacked there yet)
            _vllm_compat.repack_cpu_gemms(self.llm)
        if self._exact is not None:
            self._exact.refresh()
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                _vllm_compat.shutdown(llm, keep_default_group=self._callers_group)
            finally:
                _vllm_compat.remove_dynamo_bytecode_hooks(self._dynamo_hooks)


class HfEngine(RolloutEngine):
    """transformers ``generate`` on the unified model: the trainer's own forward, or for an
    off-policy recipe (``fp8_rollout_only``) the same model with the recipe's rollout GEMM."""

    name = "hf"

    def __init__(
        self, model: nn.Module, *, tokenizer=None, eos_token_id: int | None = None, pad_token_id: int | None = None
    ):
        self.model = model
        self.recipe, _ = rollout_recipe_and_cache(model)
        config = model.config
        self.eos_token_id = eos_token_id if eos_token_id is not None else _first(getattr(config, "eos_token_id", None))
        pad = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_id if self.eos_token_id is not None else 0)

    def generate(self, prompts, *, n=1, max_new_tokens=64, temperature=1.0, seed=0):
        model = self.model
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling = rollout_forward(model) if is_unified(model) else contextlib.nullcontext()
        # FSDP2: every forward is a collective, so ranks decode in step until all are done, and the
        # shared prefill (one forward fewer, depending on the prompts) is left out
        sharded = is_sharded(model)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), sampling:
            torch.manual_seed(seed)
            # temperature 0 is greedy (as in vLLM); the n copies of each prompt are made here, the
            # way generate would, since greedy generate refuses num_return_sequences > 1
            sampling_args = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
                else dict(do_sample=False)
            out = model.generate(
                input_ids=ids.repeat_interleave(n, dim=0).to(device),
                attention_mask=mask.repeat_interleave(n, dim=0).to(device),
                past_key_values=None if sharded else self._shared_prefill(ids.to(device), mask.to(device), n),
                synced_gpus=True if sharded else None,  # None: transformers decides, as before
                max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                output_logits=True, return_dict_in_generate=True, **sampling_args,
            )
        tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B*n, T, V): raw, before temperature
        logprobs = logprobs_of(model, logits, tokens)
        result = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                row, lp = tokens[i * n + j].tolist(), logprobs[i * n + j].tolist()
                stopped = self.eos_token_id in row
                end = row.index(self.eos_token_id) + 1 if stopped else len(row)
                group.append(Completion(row[:end], lp[:end], "stop" if stopped else "length"))
            result.append(group)
        return result

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int):
        """The KV cache of every prompt but its last token, computed once per prompt and repeated
        for its ``n`` samples (``generate`` would prefill each prompt ``n`` times); ``generate``
        then runs the last prompt token and decodes. None when there is nothing to share."""
        if n == 1 or ids.shape[1] < 2:
            return None
        head, head_mask = ids[:, :-1], mask[:, :-1]
        positions = (head_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded prompts
        cache = self.model(input_ids=head, attention_mask=head_mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(n)
        return cache

    def sync(self, model: nn.Module) -> float:
        if model is not self.model:
            raise ValueError("HfEngine samples from the model it was built with; sync it with that same model")
        return 0.0  # it reads the trainer's parameters (and weight cache) directly


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x
