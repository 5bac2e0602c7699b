"""TRL's ``GRPOTrainer`` on the unified flow: two changed lines in a TRL script.

    import jetrl_compile
    from jetrl_compile.integrations.trl import UnifiedGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    model = jetrl_compile.unify(model, recipe="fp8_fwd_bf16_bwd")            # added
    trainer = UnifiedGRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(..., bf16=False),
                                 train_dataset=..., processing_class=tokenizer)  # was GRPOTrainer
    trainer.train()

TRL keeps everything it does (data, rewards, advantages, loss, logging); the unified model's
forward is the recipe's (every eligible linear the FP8 op, BF16 backward), and where the samples
come from is TRL's choice:

- ``use_vllm=False`` (TRL's default): TRL's ``generate`` on the unified model, so the sampler is
  the trainer's own FP8 forward (for ``fp8_rollout_only``, the recipe's rollout GEMM, as
  ``HfEngine`` samples). TRL keeps no sampler logprobs on this path and logs no ``sampling/``
  metrics: it takes these samples as on-policy, which they are up to the rounding that differs
  between one-token decode steps and the full-sequence forward (docs/design.md, section 8).
- ``use_vllm=True, vllm_mode="colocate"``: our ``VllmEngine`` on the export of the unified model
  (vLLM's every linear the trainer's FP8 op on the trainer's own quantized weights), given the new
  FP8 payloads and scales after each optimizer step. TRL's own colocated vLLM would load the
  model's source checkpoint in full precision and push full-precision weights, which the
  ``jetrl`` method refuses. vLLM's logprobs (after temperature, as TRL recomputes them) go back to
  TRL, which logs ``sampling/sampling_logp_difference/{mean,max}`` and applies its importance
  sampling correction as for any vLLM run.
- ``vllm_mode="server"`` is refused: TRL's server receives full-precision weights over NCCL.

TRL scores left-padded prompts without position ids; the trainer gives the model a forward
pre-hook (``positions_from_mask``) that numbers each row from its first token, as vLLM does.

Precision stays the recipe's, so two of GRPOConfig's defaults are refused where they would leave
it: ``bf16=True`` runs the forward under autocast, which recasts every op the recipe leaves alone
(the logits head, attention): load the model in the dtype you want and pass ``bf16=False``. And
``gradient_checkpointing=True`` with a whole-model compile (``unify(mode="compile",
regional=False)``) recomputes each layer outside the compiled graph, where its linears are plain
``nn.Linear`` again; regional compile (the default: it recomputes the compiled layer itself) and
eager mode (``unify(mode="eager")``) keep the recipe through the recomputation and are accepted.
GRPOTrainer computes logprobs with its own fused LM head from ``lm_head.weight`` (tiled, in the
weight's dtype), so the logits head is never quantized here (``include_lm_head=True`` is refused).
In exact mode everything below the head is the engine's function, but TRL's head GEMM and
log-softmax are not ours, so its logprobs differ from the engine's by float32 rounding (about 1e-5
per token on the default model), not zero.
One process only for now (no DDP/FSDP, no tensor parallel vLLM), and no PEFT adapters.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import trl
from trl import GRPOConfig, GRPOTrainer

from ..rollout.engines import VllmEngine
from ..state import is_unified, unified_state
from ..unify import rollout_forward

# TRL's colocated vLLM logs these from the sampler's and the trainer's logprobs
MISMATCH_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
# the TRL release this host was written and tested against (the trl extra pins it), and the
# GRPOTrainer internals it relies on besides the public constructor
WRITTEN_FOR = "1.16.0"
_TRL_HOOKS = ("_generate_single_turn", "eos_token_ids", "vllm_generation", "_last_loaded_step")


class UnifiedGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` for a model returned by ``jetrl_compile.unify`` (see the module doc).

    ``engine_options``: keyword arguments for the colocated ``VllmEngine`` (``kv_cache_gib``,
    ``max_num_batched_tokens``, ``dtype``, ``in_process``...), with ``use_vllm=True`` only.
    """

    def __init__(self, model: nn.Module, reward_funcs, args: GRPOConfig | None = None, *,
                 engine_options: dict | None = None, **kwargs):
        _check_model(model)
        if args is None:
            args = GRPOConfig(f"{type(model).__name__}-GRPO", bf16=False)
        _check_args(model, args, kwargs, engine_options)
        # TRL would start its own vLLM on the model's source checkpoint; ours starts once TRL is set up
        trl_args = copy.copy(args)
        trl_args.use_vllm = False
        super().__init__(model, reward_funcs, args=trl_args, **kwargs)
        _check_trl(self)
        if self.accelerator.num_processes > 1:
            raise ValueError("UnifiedGRPOTrainer runs in one process for now: launch it without accelerate/torchrun")
        self.args = args
        self.unified_model = model
        self._positions_hook = model.register_forward_pre_hook(positions_from_mask, with_kwargs=True)
        if args.use_vllm:
            self.vllm_generation = ColocatedEngine(model, args, self.eos_token_ids, engine_options or {})
            self.use_vllm = True
            self._last_loaded_step = -1  # GRPOTrainer syncs when the optimizer step moves past this

    def _generate_single_turn(self, *args, **kwargs):
        # TRL's transformers path calls generate on the model: give it the recipe's rollout GEMM
        sampling = rollout_forward(self.unified_model) if not self.use_vllm else contextlib.nullcontext()
        with sampling:
            return super()._generate_single_turn(*args, **kwargs)

    def close(self) -> None:
        """Stop the colocated vLLM engine, if any, and take the position hook off the model."""
        self._positions_hook.remove()
        if self.use_vllm:
            self.vllm_generation.engine.close()


def positions_from_mask(module: nn.Module, args: tuple, kwargs: dict):
    """A forward pre-hook: position ids counted from each row's first unmasked token when the
    caller passes none. GRPOTrainer scores left-padded prompts without position ids, so
    transformers numbers every row from its first pad and a shorter prompt's tokens sit at shifted
    positions; vLLM (and ``generate``) number each prompt from its first token. The two are the
    same function only in exact arithmetic: on the default model in exact mode, the shifted
    rows' logprobs differed from vLLM's by up to 0.8, and by float32 rounding with the ids."""
    mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
    if kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and ids is not None:
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[-1]:]
    return args, kwargs


class ColocatedEngine:
    """Stands where ``GRPOTrainer`` keeps its colocated vLLM (``trainer.vllm_generation``): TRL
    calls ``sync_weights()`` once per optimizer step and ``generate(...)`` for every batch of
    prompts, each prompt already repeated ``num_generations`` times."""

    def __init__(self, model: nn.Module, args: GRPOConfig, eos_token_ids: list[int], engine_options: dict):
        self.model = model
        options = dict(seed=args.seed, logprobs_mode="processed_logprobs")
        if args.vllm_max_model_length is not None:
            options["max_model_len"] = args.vllm_max_model_length
        self.engine = VllmEngine(model, **{**options, **engine_options})
        self.llm = self.engine.llm  # TRL reads the context length off it for multi-turn tool calls
        self.sampling = dict(
            n=1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_completion_length, logprobs=0, detokenize=False,
            stop_token_ids=list(eos_token_ids), **(args.generation_kwargs or {}),
        )

    def sync_weights(self) -> None:
        self.engine.sync(self.model)

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """TRL's colocated ``generate``: (prompt ids, completion ids, logprobs, their token ids),
        one row per completion, ``[token][0]`` the sampled token's."""
        from vllm import SamplingParams

        if images is not None and any(i is not None for i in images):
            raise ValueError("UnifiedGRPOTrainer samples text only; images need a multimodal model")
        with profiler if profiler is not None else contextlib.nullcontext():
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompts], SamplingParams(**self.sampling), use_tqdm=False
            )
        completions = [c for out in outputs for c in out.outputs]
        return (
            [list(out.prompt_token_ids) for out in outputs],
            [list(c.token_ids) for c in completions],
            [[[step[tok].logprob] for tok, step in zip(c.token_ids, c.logprobs)] for c in completions],
            [[[tok] for tok in c.token_ids] for c in completions],
        )


def _check_trl(trainer: GRPOTrainer) -> None:
    """The names this host uses inside GRPOTrainer exist (``vllm_generation`` and
    ``_last_loaded_step`` are set only on TRL's vLLM path, so they are looked up in its source)."""
    import inspect

    source = inspect.getsource(GRPOTrainer)
    missing = [name for name in _TRL_HOOKS if not hasattr(trainer, name) and f"self.{name}" not in source]
    if missing:
        raise RuntimeError(
            f"jetrl_compile.integrations.trl was written for TRL {WRITTEN_FOR}; the installed TRL {trl.__version__} "
            f"has no GRPOTrainer.{', '.join(missing)}. Install the trl extra (pip install -e '.[trl]')"
        )


def _check_model(model) -> None:
    if not isinstance(model, nn.Module) or not is_unified(model):
        what = repr(model) if isinstance(model, str) else type(model).__name__
        raise ValueError(
            f"UnifiedGRPOTrainer trains a unified model, not {what}: load it, then "
            "model = jetrl_compile.unify(model, recipe=...), and pass that model"
        )


def _check_args(model: nn.Module, args: GRPOConfig, kwargs: dict, engine_options: dict | None) -> None:
    """Refuse, by name and with the fix, what would make TRL train off the recipe."""
    state, problems = unified_state(model), []
    if state.recipe.include_lm_head:
        problems.append(
            "include_lm_head=True: GRPOTrainer computes logprobs from lm_head.weight with its own fused head, "
            "never through the quantized module; unify without include_lm_head"
        )
    if args.gradient_checkpointing and state.mode == "compile" and not state.layer_groups:
        problems.append(
            "gradient_checkpointing=True (TRL's default) recomputes each layer outside the whole-model compiled "
            "graph, where its linears would run in the model's dtype: unify with regional=True (the default) or "
            "mode='eager' (either keeps the recipe when a layer is recomputed), or pass gradient_checkpointing=False"
        )
    if args.bf16 or args.fp16:
        problems.append(
            f"{'bf16' if args.bf16 else 'fp16'}=True runs the forward under autocast, which recasts every op the "
            "recipe leaves alone: pass GRPOConfig(bf16=False) and load the model in the dtype you want"
        )
    if kwargs.get("peft_config") is not None:
        problems.append("PEFT adapters are not in the recipe: train the full model (drop peft_config)")
    if args.use_vllm and args.vllm_mode != "colocate":
        problems.append(
            f"vllm_mode={args.vllm_mode!r}: TRL's vLLM server receives full-precision weights; use "
            "vllm_mode='colocate' (our engine, synced with the FP8 weights) or use_vllm=False"
        )
    if args.use_vllm and (args.vllm_tensor_parallel_size != 1 or args.vllm_enable_sleep_mode):
        problems.append("the colocated engine runs on one device without sleep mode: "
                        "vllm_tensor_parallel_size=1, vllm_enable_sleep_mode=False")
    if engine_options and not args.use_vllm:
        problems.append("engine_options configure the colocated vLLM engine: set use_vllm=True or drop them")
    if problems:
        raise ValueError("UnifiedGRPOTrainer: " + "; ".join(problems))
