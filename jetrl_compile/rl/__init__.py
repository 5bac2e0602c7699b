"""The GRPO driver's pieces: trainer logprobs, rollout/trainer mismatch, rewards, loss, loop."""

from .logprobs import token_logprobs
from .mismatch import mismatch_metrics

__all__ = ["mismatch_metrics", "token_logprobs"]
