"""Rollout correction: importance weights for tokens sampled by a policy the trainer does not compute.

Where the rollout engine's policy differs from the trainer's (``fp8_rollout_only``, or any flow
that is not exact), the peers weight each token's policy-gradient term by the importance ratio
of the trainer's probability to the rollout's, bounded so that its variance stays finite:

- ``tis`` (truncated importance sampling): ``w = min(r, clip)``;
- ``mis`` (masked importance sampling): ``w = r`` where ``low <= r <= clip``, else ``0`` (the
  token, or the whole completion, drops out of the gradient);

with ``r = exp(log p_trainer - log p_rollout)`` per token (``level="token"``), or one ratio per
completion, ``R = exp(sum over its tokens)``, given to all its tokens (``level="sequence"``). The
weights are constants (no gradient flows through them). With a correction the PPO ratio is
taken against the trainer's own logprobs of the batch (1 in value for one update per batch) and
the weight carries the rollout/trainer difference, as verl's ``rollout_is`` and TRL's
``vllm_importance_sampling_correction`` do; without one (``none``) the PPO ratio is taken
against the rollout's logprobs, and PPO's clip is the only bound.

The metrics use the peers' words: the ratio's mean, min and max at the chosen level, and the
fraction of tokens whose weight the bound changed (truncated or masked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UsageValueError

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RolloutCorrection:
    mode: str = "none"
    level: str = "token"
    clip: float = 2.0  # tis: the largest weight; mis: ratios above it are masked
    low: float = 0.0  # mis: ratios below it are masked too

    def __post_init__(self):
        if self.mode not in MODES:
            raise UsageValueError(f"rollout correction {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.level not in LEVELS:
            raise UsageValueError(f"rollout correction level {self.level!r}: choose one of {', '.join(LEVELS)}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise UsageValueError(f"--is-clip must be a positive number; got {self.clip}")
        if not (0 <= self.low < self.clip):
            raise UsageValueError(f"--is-low must be in [0, --is-clip) = [0, {self.clip}); got {self.low}")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def ratios(self, trainer_logprobs: list[torch.Tensor], rollout_logprobs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The importance ratio at this level, per token (float64, no gradient), one tensor per completion."""
        if len(trainer_logprobs) != len(rollout_logprobs):
            raise ValueError(f"rollout correction: {len(trainer_logprobs)} trainer but "
                             f"{len(rollout_logprobs)} rollout completions")
        ratios = []
        for new, old in zip(trainer_logprobs, rollout_logprobs):
            d = new.detach().double() - old.to(new.device, torch.float64)
            ratios.append(torch.exp(d) if self.level == "token" else torch.exp(d.sum()).expand(len(d)))
        return ratios

    def _kept(self, r: torch.Tensor) -> torch.Tensor:
        """Where the weight is the ratio itself (the bound does not change it)."""
        if self.mode == "tis":
            return r <= self.clip
        if self.mode == "mis":
            return (r >= self.low) & (r <= self.clip)
        return torch.ones_like(r, dtype=torch.bool)

    def weights(self, trainer_logprobs: list[torch.Tensor], rollout_logprobs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token weights (float32, no gradient), one tensor per completion; all 1 for ``none``."""
        weights = []
        for r in self.ratios(trainer_logprobs, rollout_logprobs):
            if self.mode == "tis":
                w = r.clamp(max=self.clip)
            elif self.mode == "mis":
                w = torch.where(self._kept(r), r, torch.zeros_like(r))
            else:
                w = torch.ones_like(r)
            weights.append(w.float())
        return weights

    def metrics(self, trainer_logprobs: list[torch.Tensor], rollout_logprobs: list[torch.Tensor]) -> dict[str, float]:
        """The ratio's mean, min and max at this level (over tokens, or over completions), and the
        fraction of tokens whose weight the bound truncated or masked (0 for ``none``)."""
        ratios = [r for r in self.ratios(trainer_logprobs, rollout_logprobs) if len(r)]
        if not ratios:
            raise ValueError("rollout correction: no tokens")
        flat = torch.cat(ratios)
        per = torch.stack([r[0] for r in ratios]) if self.level == "sequence" else flat
        return {
            "is_ratio_mean": per.mean().item(),
            "is_ratio_min": per.min().item(),
            "is_ratio_max": per.max().item(),
            "is_corrected_frac": (~self._kept(flat)).double().mean().item(),
        }
