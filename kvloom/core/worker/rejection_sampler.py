"""Verification of draft tokens against the target model, batched over every row of a step.

Greedy rows keep a draft while it equals the target's argmax. Sampled rows use rejection sampling
(Leviathan et al. 2023, Chen et al. 2023), which leaves the target distribution exactly as it is: a
draft ``d`` proposed with probability ``q(d)`` is kept with probability ``min(1, p(d) / q(d))``; when
it is rejected, the replacement is drawn from ``max(p - q, 0)`` renormalised. The proposers in
kvloom are deterministic (n-gram lookup, a greedy draft model), so ``q`` is one-hot at ``d``: keep
``d`` with probability ``p(d)``, else draw from ``p`` with ``d`` removed. The row after the last
kept draft draws from ``p`` itself (the bonus token when all drafts are kept).

Rows are laid out per sequence: one row per draft, then one more; the bonus row's draft is ``-1``.
"""

from __future__ import annotations

import torch

from kvloom.core.sampling_params import SamplingParams


def host_to_device(data, dtype, device) -> torch.Tensor:
    """A small host list on the device without stalling: a pageable copy would wait for the forward
    queued before it, leaving the GPU idle while the sampler's kernels are launched after it."""
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def greedy_or_sample(logits: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor,
                     row_params: list[SamplingParams]) -> torch.Tensor:
    """One token per row: argmax for greedy rows, a draw from ``probs`` for the others. Drawing is
    ``argmax(p / E)`` with ``E ~ Exponential(1)``, which samples from ``p`` without a host sync."""
    sampled = (probs / noise).argmax(dim=-1)
    if not any(p.greedy for p in row_params):
        return sampled
    greedy = host_to_device([p.greedy for p in row_params], torch.bool, logits.device)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def verify(logits: torch.Tensor, probs: torch.Tensor | None, drafts: torch.Tensor, noise: torch.Tensor | None,
           uniform: torch.Tensor | None, row_params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one draft per row (``drafts[r] == -1``: none, the row only draws the next token).

    :param logits: ``[R, V]`` processed logits (penalties, min_tokens applied); greedy rows use them.
    :param probs: ``[R, V]`` target distributions (temperature, top-k/p, min-p applied; need not sum to
        one), or None when every row is greedy.
    :param noise: ``[R, V]`` Exponential(1) noise for the draws; ``uniform``: ``[R]`` in [0, 1) for the
        accept tests. Both come from each request's own generator where it has a seed.
    :return: ``tokens[r]``, the target's token for row ``r`` (the replacement when its draft is rejected),
        and ``accepted[r]``. A sequence keeps its drafts up to the first rejected one, then takes
        that row's token; later rows are discarded by the caller.
    """
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    greedy_tokens = logits.argmax(dim=-1)
    if probs is None:
        return greedy_tokens, has_draft & (greedy_tokens == drafts)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    p_draft = probs.gather(1, safe[:, None])[:, 0]
    accepted_random = has_draft & (uniform < p_draft)
    # The residual max(p - onehot(d), 0) is p with d taken out (renormalising does not change a draw).
    residual = probs.scatter(1, safe[:, None], torch.where(has_draft, 0.0, p_draft)[:, None])
    # A row whose draft held all the mass is never rejected; keep its draw well-defined anyway.
    empty = residual.sum(dim=-1) <= 0
    residual = torch.where(empty[:, None], probs, residual)
    drawn = (residual / noise).argmax(dim=-1)
    greedy = host_to_device([p.greedy for p in row_params], torch.bool, logits.device)
    tokens = torch.where(greedy, greedy_tokens, drawn)
    accepted = torch.where(greedy, has_draft & (greedy_tokens == drafts), accepted_random)
    return tokens, accepted
