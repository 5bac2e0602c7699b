"""How far the rollout engine's sampling distribution is from the trainer's, on sampled tokens.

For each sampled token, ``d = log p_trainer - log p_rollout``. With samples drawn from the
rollout policy, ``r = exp(d)`` is the importance ratio that corrects for the difference; on-policy
means ``r == 1``. For a whole completion, ``D = sum(d)`` and ``R = exp(D)``. Reported:

- ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: mean and max ``|d|``;
- ``mismatch_kl``: the k3 estimator of KL(rollout || trainer), ``r - 1 - log r``, token mean
  (unbiased, always >= 0; Schulman's "Approximating KL divergence");
- ``mismatch_k1``: the k1 estimator of the same KL, ``-d``, token mean (unbiased, can be < 0);
- ``mismatch_chi2``: the chi-square divergence of the trainer from the rollout per token,
  ``mean(r**2) - 1``: the variance an importance weight adds;
- ``mismatch_k1_seq``, ``mismatch_k3_seq``, ``mismatch_chi2_seq``: the same per completion, with
  ``D`` and ``R`` in place of ``d`` and ``r``, averaged over completions (how far apart the two
  distributions over whole completions are);
- ``ratio_outside_frac``: fraction of tokens with ``r`` outside [0.5, 2], i.e. ``|d| > ln 2``,
  the tokens a clipped or truncated importance weight would distort the most.
"""

from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def mismatch_metrics(rollout_logprobs, trainer_logprobs) -> dict[str, float]:
    """Mismatch of two sets of sampled-token logprobs, each a list with one sequence (list or
    tensor) per completion, or one flat list or tensor. A flat side takes the other side's
    completions; two flat sides count as one completion."""
    rollout, trainer = _sequences(rollout_logprobs), _sequences(trainer_logprobs)
    r_flat, t_flat = torch.cat(rollout), torch.cat(trainer)
    if r_flat.shape != t_flat.shape:
        raise ValueError(f"mismatch_metrics: {r_flat.numel()} rollout logprobs but {t_flat.numel()} trainer logprobs")
    if r_flat.numel() == 0:
        raise ValueError("mismatch_metrics: no tokens to compare")
    if len(trainer) == 1:
        trainer = list(t_flat.split([len(s) for s in rollout]))
    elif len(rollout) == 1:
        rollout = list(r_flat.split([len(s) for s in trainer]))
    if [len(s) for s in rollout] != [len(s) for s in trainer]:
        raise ValueError("mismatch_metrics: the rollout's and the trainer's completions differ in length")
    d = t_flat - r_flat
    seq = torch.stack([(t - r).sum() for r, t in zip(rollout, trainer)])
    return {
        "tokens": int(d.numel()),
        "logprob_abs_diff_mean": d.abs().mean().item(),
        "logprob_abs_diff_max": d.abs().max().item(),
        "mismatch_kl": _k3(d),
        "mismatch_k1": (-d).mean().item(),
        "mismatch_chi2": torch.expm1(2 * d).mean().item(),
        "mismatch_k1_seq": (-seq).mean().item(),
        "mismatch_k3_seq": _k3(seq),
        "mismatch_chi2_seq": torch.expm1(2 * seq).mean().item(),
        "ratio_outside_frac": (d.abs() > _LN2).double().mean().item(),
    }


def _k3(d: torch.Tensor) -> float:
    return (torch.expm1(d) - d).mean().item()


def _sequences(x) -> list[torch.Tensor]:
    """One float64 CPU tensor per completion."""
    if isinstance(x, torch.Tensor) or (len(x) and not isinstance(x[0], (list, tuple, torch.Tensor))):
        return [_flat(x)]
    return [_flat(s) for s in x]


def _flat(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double().flatten().cpu()
    items = [_flat(v) if isinstance(v, (list, tuple, torch.Tensor)) else torch.tensor([float(v)], dtype=torch.float64)
             for v in x]
    return torch.cat(items) if items else torch.zeros(0, dtype=torch.float64)


def rollout_mismatch(model, engine, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 64,
                     temperature: float = 1.0, seed: int = 0, pad_token_id: int = 0,
                     batch_size: int = 16) -> dict[str, float]:
    """Sample with ``engine``, recompute the sampled tokens' logprobs with ``model`` (no grad, in
    batches of about ``batch_size`` sequences, whole groups) and return ``mismatch_metrics`` of the two."""
    from .logprobs import group_logprobs

    groups = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    per_batch = max(1, batch_size // n)
    rollout, trainer = [], []
    with torch.no_grad():
        for i in range(0, len(prompts), per_batch):
            chunk = [[c for c in g if c.token_ids] for g in groups[i : i + per_batch]]
            trainer += group_logprobs(model, prompts[i : i + per_batch], [[c.token_ids for c in g] for g in chunk],
                                      pad_token_id=pad_token_id)
            rollout += [c.logprobs for g in chunk for c in g]
    return mismatch_metrics(rollout, trainer)
