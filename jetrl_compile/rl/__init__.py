"""The GRPO driver's pieces: trainer logprobs, rollout/trainer mismatch, rewards, loss, loop."""

from .logprobs import group_logprobs, token_logprobs
from .mismatch import mismatch_metrics

__all__ = ["group_logprobs", "mismatch_metrics", "token_logprobs"]
