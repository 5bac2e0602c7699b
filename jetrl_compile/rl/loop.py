"""The GRPO loop on one precision flow.

Per step, as in the paper's algorithm:

1. ``sample_prompts``: a batch of problems from the task;
2. ``rollout``: G completions per prompt from the engine (vLLM running the trainer's FP8 op),
   with the logprob of every sampled token;
3. ``score``: exact-answer + format rewards;
4. ``group_advantages``: rewards normalised within each prompt's group;
5. ``policy_update``: the trainer (the unified model: FP32 master weights, every GEMM from the
   recipe's BF16/FP8 copies) recomputes the sampled tokens' logprobs (one packed forward per
   group: the prompt once, its G completions beside it), takes the clipped policy
   loss against the rollout's logprobs (or, with a rollout correction, against its own, each
   token weighted by the bounded trainer/rollout ratio), and steps AdamW; a non-finite loss or
   gradient refuses the step (weights and optimizer state untouched);
6. ``engine.sync``: the new quantized weights go into the engine in place.

The trainer's recomputed logprobs double as the rollout/trainer mismatch measurement.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageValueError
from ..models import load_model
from ..rollout.engines import Completion, make_engine
from ..unify import unify
from . import parallel
from .checkpoint import latest_checkpoint, load_checkpoint, restore_rng, rng_state, save_checkpoint
from .config import EVAL_OWN, GrpoConfig
from .grpo import clipped_policy_loss, group_advantages
from .logprobs import group_logprobs
from .mismatch import mismatch_metrics
from .parallel import ONE_PROCESS, Ranks
from .plot import plot_metrics
from .report import make_report
from .run_folder import check_run_folder, clear_run, finite_row, json_text
from .tasks import Problem, Task, make_task

log = logging.getLogger("jetrl_compile.grpo")
MAX_GRAD_NORM = 1.0


@dataclass
class UpdateStats:
    applied: bool
    loss: float
    grad_norm: float
    clip_frac: float
    mismatch: dict
    first_difference: tuple | None = None  # (prompt, sample, token) where the two logprobs first differ
    correction: dict | None = None  # importance ratio and the fraction of tokens truncated or masked


class EngineFailure(RuntimeError):
    """The rollout engine could not generate. ``transient``: a failure of the engine itself (its
    process, memory, a connection), which a fresh engine may not meet, so a resume can help; a
    refused request or an error the retry met again would come back on resume."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


# what an engine raises when it refuses the request itself (vLLM's validation of its sampling
# parameters and prompt lengths): asking again, now or after a resume, gets the same answer
ENGINE_REFUSALS = (ValueError, TypeError)
# what a failing engine (not request) raises: its process died, memory ran out, a connection broke
ENGINE_FAILURES = (OSError, MemoryError, TimeoutError)
ENGINE_FAILURE_NAMES = ("EngineDeadError", "OutOfMemoryError")  # vLLM's, torch's (a RuntimeError)


def _engine_itself_failed(error: BaseException) -> bool:
    return isinstance(error, ENGINE_FAILURES) or type(error).__name__ in ENGINE_FAILURE_NAMES


def sample_prompts(task: Task, tokenizer, batch_size: int) -> tuple[list[Problem], list[list[int]]]:
    problems = [task.sample() for _ in range(batch_size)]
    return problems, [task.prompt_ids(tokenizer, p) for p in problems]


def rollout(engine, prompts, cfg: GrpoConfig, step: int, counters: dict, rank: int = 0) -> list[list[Completion]]:
    """G completions per prompt. A refused request raises EngineFailure at once; any other engine
    error is retried once, then raised as EngineFailure (transient where the engine itself failed,
    or the retry failed otherwise than the first try)."""
    seed = cfg.seed * 1_000_003 + step * 10_007 + rank * 7_919
    first = None
    for attempt in (1, 2):
        try:
            return engine.generate(prompts, n=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, seed=seed)
        except Exception as e:  # noqa: BLE001 - any engine error: retry once, then stop cleanly
            if isinstance(e, ENGINE_REFUSALS):
                raise EngineFailure(f"rollout engine {engine.name} refused step {step + 1}'s request: "
                                    f"{type(e).__name__}: {e}", transient=False) from e
            counters["engine_retries"] += 1
            log.warning("rollout engine %s failed at step %d (attempt %d): %s", engine.name, step + 1, attempt, e)
            if attempt == 1:
                first = (type(e), str(e))
                continue
            again = first == (type(e), str(e))
            raise EngineFailure(f"rollout engine {engine.name} failed twice at step {step + 1}: {e}",
                                transient=_engine_itself_failed(e) or not again) from e
    raise AssertionError("unreachable")


def score(task: Task, tokenizer, problems: list[Problem],
          groups: list[list[Completion]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, correct), each of shape (prompts, G)."""
    rewards, correct = [], []
    for problem, group in zip(problems, groups):
        scored = [task.score(tokenizer.decode(c.token_ids, skip_special_tokens=True), problem) for c in group]
        rewards.append([r for r, _ in scored])
        correct.append([float(ok) for _, ok in scored])
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(correct)


def policy_update(model, optimizer, prompts, groups, advantages: torch.Tensor, cfg: GrpoConfig, pad_token_id: int,
                  ref_model=None, ranks: Ranks = ONE_PROCESS, trainer=None) -> UpdateStats:
    """One optimizer step on the clipped policy loss, token-level mean over the whole batch,
    accumulated over micro-batches of whole groups (each prompt runs once for its G completions).
    Refused (no step) if the loss or gradient is not finite.

    Data-parallel (``ranks``): ``prompts`` and ``groups`` are this rank's share, ``trainer`` is DDP
    around ``model``; the loss is scaled so that DDP's average is the mean over every rank's tokens,
    and the statistics are over the whole batch."""
    trainer = trainer if trainer is not None else model
    total_tokens = ranks.total(sum(len(c.token_ids) for g in groups for c in g))
    correction = cfg.correction()
    per_micro_batch = max(1, cfg.micro_batch // cfg.group_size)
    optimizer.zero_grad(set_to_none=True)
    loss_sum, clipped, new_all, old_all, where = 0.0, 0, [], [], []
    for start in range(0, len(prompts), per_micro_batch):
        mb = range(start, min(start + per_micro_batch, len(prompts)))
        kept = [[(j, c) for j, c in enumerate(groups[i]) if c.token_ids] for i in mb]  # empty ones add nothing
        if not any(kept):
            if ranks.distributed:  # every rank must run as many backwards (DDP reduces in each)
                ids = torch.tensor([prompts[mb.start]], device=next(model.parameters()).device)
                trainer(input_ids=ids).logits.sum().mul(0.0).backward()
            continue
        mb_prompts = [prompts[i] for i in mb]
        mb_groups = [[c.token_ids for _, c in row] for row in kept]
        new = group_logprobs(model, mb_prompts, mb_groups, pad_token_id=pad_token_id, forward=trainer)
        old = [torch.tensor(c.logprobs) for row in kept for _, c in row]
        adv = torch.stack([advantages[i, j] for i, row in zip(mb, kept) for j, _ in row])
        ref = None
        if ref_model is not None and cfg.beta:
            with torch.no_grad():
                ref = group_logprobs(ref_model, mb_prompts, mb_groups, pad_token_id=pad_token_id)
        if correction.active:  # PPO's ratio against the trainer itself; the weight carries the rollout's difference
            parts = clipped_policy_loss(new, [n.detach() for n in new], adv, clip_eps=cfg.clip_eps, ref_logprobs=ref,
                                        beta=cfg.beta, weights=correction.weights(new, old))
        else:
            parts = clipped_policy_loss(new, old, adv, clip_eps=cfg.clip_eps, ref_logprobs=ref, beta=cfg.beta)
        (parts.loss_sum * ranks.world / total_tokens).backward()
        loss_sum += parts.loss_sum.item()
        clipped += parts.clipped
        new_all += [n.detach().cpu() for n in new]  # gathered across ranks as objects; small
        old_all += old
        where += [(ranks.rank * len(prompts) + i, j) for i, row in zip(mb, kept) for j, _ in row]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # FSDP2
    loss_sum, clipped = ranks.total(loss_sum), ranks.total(clipped)
    applied = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ranks.distributed:  # the statistics are over every rank's tokens
        new_all, old_all, where = (sum(ranks.gather(x), []) for x in (new_all, old_all, where))
    return UpdateStats(applied, loss_sum / total_tokens, grad_norm, clipped / total_tokens,
                       mismatch_metrics(old_all, new_all), _first_difference(old_all, new_all, where),
                       correction.metrics(new_all, old_all))


def _first_difference(rollout, trainer, where) -> tuple[int, int, int] | None:
    """(prompt, sample, token) of the first sampled token whose two logprobs are not bitwise equal."""
    for (i, j), a, b in zip(where, rollout, trainer):
        differs = (a.float().cpu() != b.float().cpu()).nonzero()
        if len(differs):
            return i, j, int(differs[0])
    return None


def train(cfg: GrpoConfig, *, model=None, tokenizer=None, task: Task | None = None,
          progress: bool = True) -> list[dict]:
    """Run GRPO as ``cfg`` says; returns the metrics of the steps run in this call. What is wrong
    with the paths, ``--out`` or the task's data stops it before a model loads or a file is written."""
    cfg.check_paths(model=model is None)
    found = check_run_folder(cfg.out, resume=cfg.resume, overwrite=cfg.overwrite, steps=cfg.steps)
    task = task or make_task(cfg.task, seed=cfg.seed, data=cfg.data, difficulty=cfg.difficulty)
    ranks = parallel.start(cfg.parallel, cfg.batch_size, cfg.resolved_device())
    try:
        return _train(cfg, ranks, found, model, tokenizer, task, progress)
    finally:
        parallel.stop(ranks)


def _train(cfg: GrpoConfig, ranks: Ranks, found: Path | None, model, tokenizer, task, progress: bool) -> list[dict]:
    out = Path(cfg.out)
    state = load_checkpoint(found, cfg.run_defining(), ranks.world) if cfg.resume else None
    if cfg.overwrite and ranks.main:
        gone = clear_run(out)
        log.info("--overwrite: deleted %s from %s", ", ".join(gone) or "nothing", out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model, tokenizer, task, pad = _setup(cfg, model, tokenizer, task, ranks.device)
    model.config.use_cache = False
    ref_model = _reference_copy(model, cfg) if cfg.beta else None
    mode = cfg.resolved_trainer_mode()
    unify(model, cfg.recipe, mode=mode, dynamic=True if mode == "compile" else None, exact=cfg.exact)
    trainer = parallel.wrap(model, ranks)  # DDP around the unified model, or the model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    start, counters = 0, {"refused_steps": 0, "engine_retries": 0}
    if state is not None:
        parallel.load_state_dicts(model, optimizer, state["model"], state["optimizer"], ranks)
        task.load_state_dict(state["task"])
        restore_rng(state, ranks.rank)
        start, counters = state["step"], state["counters"]
        if ranks.main:
            _truncate_metrics(metrics_path, start)
        log.info("resumed %s at step %d", found, start)
    elif ranks.main:
        metrics_path.write_text("")
    if ranks.main:
        settings = {**cfg.to_dict(), "trainer_mode": mode, "device": ranks.device}  # as it runs, not "auto"
        (out / "config.json").write_text(json_text(settings, indent=2))

    report = make_report(cfg.report_to if ranks.main else "none", out)
    engine = _engine(model, tokenizer, cfg, out / (f"engine-rank{ranks.rank}" if ranks.distributed else "engine"),
                     pad, seed=cfg.seed, ranks=ranks)
    if ranks.main:
        _log_start(cfg, mode, engine, out, ranks.device)
    bar = _progress(cfg, start) if progress and ranks.main else None
    done = start
    task_state = task.state_dict()

    def checkpoint() -> Path | None:
        """The state after the last completed step; a collective in a data-parallel run (every
        rank's RNG goes into rank 0's file)."""
        rank_rng = ranks.gather(rng_state()) if ranks.distributed else None
        model_state, optimizer_state = parallel.state_dicts(model, optimizer, ranks)
        if not ranks.main:
            return None
        return save_checkpoint(out, done, model_state, optimizer_state, task_state, cfg.run_defining(), counters,
                               rank_rng)

    def checkpoint_on_failure() -> str:
        if ranks.distributed:  # the other ranks may not reach a collective now; the last checkpoint stands
            last = latest_checkpoint(out)
            return f"the last checkpoint ({last}) stands" if last else "no checkpoint was written yet"
        return f"checkpoint of step {done} written to {checkpoint()}"

    new_metrics = []
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            problems, prompts = sample_prompts(task, tokenizer, cfg.batch_size)  # alike on every rank
            problems, prompts = ranks.share(problems), ranks.share(prompts)
            groups = rollout(engine, prompts, cfg, step, counters, ranks.rank)
            t1 = time.perf_counter()
            rewards, correct = score(task, tokenizer, problems, groups)
            advantages = group_advantages(rewards)  # per group: a group never spans ranks
            stats = policy_update(model, optimizer, prompts, groups, advantages, cfg, pad, ref_model, ranks, trainer)
            done, task_state = step + 1, task.state_dict()  # from here a checkpoint holds this step
            t2 = time.perf_counter()
            sync_s = engine.sync(model) if stats.applied else 0.0
            if not stats.applied:
                counters["refused_steps"] += 1
                log.warning("step %d refused: non-finite loss (%s) or gradient norm (%s); weights unchanged",
                            done, stats.loss, stats.grad_norm)
            if cfg.exact and stats.first_difference is not None:
                log.warning("step %d is NOT exact: prompt %d, sample %d first differs at token %d (max abs dlogp "
                            "%.3g); exact mode promises 0.0, please report this", done, *stats.first_difference,
                            stats.mismatch["logprob_abs_diff_max"])
            if ranks.distributed:  # the metrics are over the whole batch
                rewards, correct = (torch.cat(ranks.gather(x)) for x in (rewards, correct))
                groups = sum(ranks.gather(groups), [])
            evaluated = None
            if cfg.eval_every and done % cfg.eval_every == 0:  # every rank: under FSDP2 generating is a collective
                evaluated = greedy_accuracy(engine, task, tokenizer, cfg)[0]  # the engine holds this step's weights
            if ranks.main:
                row = _metrics_row(done, rewards, correct, groups, stats, t1 - t0, t2 - t1, sync_s, counters)
                if evaluated is not None:
                    row["eval_accuracy"] = evaluated
                report.log(row, done)
                with metrics_path.open("a") as f:
                    f.write(json_text(finite_row(row)) + "\n")
                new_metrics.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                                    kl=f"{row['mismatch_kl']:.1e}", step_s=f"{row['step_s']:.1f}")
            if done % cfg.save_every == 0 or done == cfg.steps:
                checkpoint()
            if ranks.main and (done % cfg.plot_every == 0 or done == cfg.steps):
                plot_metrics(metrics_path, out / "metrics.png", title=f"GRPO {cfg.recipe} ({cfg.task})")
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted: {checkpoint_on_failure()}; continue with --resume") from None
    except EngineFailure as e:
        if e.transient:
            raise SystemExit(f"{e}\n{checkpoint_on_failure()}; continue with --resume") from e
        raise SystemExit(f"{e}\n{checkpoint_on_failure()}. The engine would answer a resume the same way: "
                         "fix the cause first (run with --verbose for the engine's log)") from e
    finally:
        if bar is not None:
            bar.close()
        report.close()
        engine.close()
    return new_metrics


def _metrics_row(step, rewards, correct, groups, stats: UpdateStats, rollout_s, train_s, sync_s, counters) -> dict:
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    completions = sum(len(g) for g in groups)
    step_s = rollout_s + train_s + sync_s
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "accuracy": correct.mean().item(),
        "completions": completions,
        "completion_tokens_mean": tokens / max(1, completions),
        "mismatch_kl": stats.mismatch["mismatch_kl"],
        "logprob_abs_diff_mean": stats.mismatch["logprob_abs_diff_mean"],
        "logprob_abs_diff_max": stats.mismatch["logprob_abs_diff_max"],
        **{k: stats.mismatch[k] for k in ("mismatch_k1", "mismatch_chi2", "mismatch_k1_seq", "mismatch_k3_seq",
                                          "mismatch_chi2_seq", "ratio_outside_frac")},
        **(stats.correction or {}),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "clip_frac": stats.clip_frac,
        "refused": not stats.applied,
        "refused_steps": counters["refused_steps"],
        "rollout_s": rollout_s,
        "train_s": train_s,
        "sync_s": sync_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
    }


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint being resumed (they will be redone)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _setup(cfg: GrpoConfig, model, tokenizer, task, device: str = "cpu"):
    """What training and evaluation both start from: the model with FP32 master weights (every
    GEMM runs from the recipe's BF16/FP8 copies) on ``device``, its tokenizer, the task and the
    pad token."""
    if model is None:
        model, tokenizer = load_model(cfg.model, dtype=torch.float32)
    model.float().to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, tokenizer, task, pad


def _engine(model, tokenizer, cfg: GrpoConfig, workdir: Path, pad: int, ranks: Ranks = ONE_PROCESS, **kwargs):
    hf_tokenizer = tokenizer if hasattr(tokenizer, "save_pretrained") else None  # vLLM saves a real one
    # under --parallel, a vLLM engine per rank joins the torchrun world (external_launcher)
    return make_engine(model, cfg.engine, tokenizer=hf_tokenizer, workdir=workdir, gpu_memory=cfg.vllm_memory,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, **kwargs)


def _reference_copy(model, cfg: GrpoConfig):
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return unify(ref, cfg.recipe, mode="eager")


def _log_start(cfg: GrpoConfig, trainer_mode: str, engine, out: Path, device: str) -> None:
    """The run in a few lines, before the first step."""
    from ..runtime.cpu import describe

    log.info("model %s, recipe %s, %s trainer on %s, rollout engine %s", cfg.model, cfg.recipe, trainer_mode, device,
             engine.name)
    log.info(describe(device))
    log.info("writing %s: metrics.jsonl, metrics.png, checkpoints/ (resume with --resume)", out)


def _progress(cfg: GrpoConfig, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=f"GRPO {cfg.recipe}", unit="step", dynamic_ncols=True)


def greedy_accuracy(engine, task: Task, tokenizer, cfg: GrpoConfig) -> tuple[float, int]:
    """(exact-answer accuracy, problems) of greedy completions on ``cfg.limit`` held-out problems."""
    problems = task.eval_problems(cfg.limit)
    groups = engine.generate([task.prompt_ids(tokenizer, p) for p in problems], n=1,
                             max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed)
    _, correct = score(task, tokenizer, problems, groups)
    return correct.mean().item(), len(problems)


def evaluate(cfg: GrpoConfig, *, model=None, tokenizer=None, task: Task | None = None) -> dict:
    """Greedy accuracy on the task's held-out split (``cfg.limit`` problems), with the latest
    checkpoint in ``cfg.out`` if there is one (of the run ``cfg`` describes, but for the settings
    an evaluation may choose itself: ``EVAL_OWN``)."""
    cfg.check_paths(model=model is None)
    task = task or make_task(cfg.task, seed=cfg.seed, data=cfg.data, difficulty=cfg.difficulty)
    if not task.eval_problems(1):
        raise UsageValueError(f"--task {cfg.task}: the held-out split has no problems to evaluate")
    path = latest_checkpoint(cfg.out)
    weights_of = {k: v for k, v in cfg.run_defining().items() if k not in EVAL_OWN}
    state = load_checkpoint(path, weights_of) if path is not None else None
    model, tokenizer, task, pad = _setup(cfg, model, tokenizer, task, cfg.resolved_device())
    if state is not None:
        model.load_state_dict(state["model"])
    unify(model, cfg.recipe, mode="eager", exact=cfg.exact)
    engine = _engine(model, tokenizer, cfg, Path(cfg.out) / "eval-engine", pad)
    try:
        accuracy, problems = greedy_accuracy(engine, task, tokenizer, cfg)
    finally:
        engine.close()
    result = {"accuracy": accuracy, "problems": problems, "checkpoint": str(path) if path else None,
              "recipe": cfg.recipe, "task": cfg.task}
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out) / "eval.json").write_text(json_text(result, indent=2))
    return result
