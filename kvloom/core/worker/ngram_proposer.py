"""The ``ngram`` proposer (prompt lookup): match each request's newest ``n`` tokens, for ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``, against its own earlier tokens, and propose what
followed the earliest match. Vectorised over the batch with NumPy: one comparison per ``n`` for all
requests and positions at once, no loop over tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    name = "ngram"

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, requests: Sequence) -> dict[str, list[int]]:
        if not requests:
            return {}
        seqs = [r.all_token_ids for r in requests]
        return dict(zip((r.request_id for r in requests), propose_ngram(
            seqs, self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)))


def propose_ngram(seqs: Sequence[Sequence[int]], k: int, n_min: int, n_max: int) -> list[list[int]]:
    """Up to ``k`` draft tokens per sequence (empty where no n-gram of its tail occurs earlier)."""
    lens = np.array([len(s) for s in seqs])
    width = int(lens.max())
    tokens = np.full((len(seqs), width + k), -1, dtype=np.int64)  # -1 pads and never matches a token
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    rows = np.arange(len(seqs))
    start = np.full(len(seqs), -1)  # where each sequence's continuation starts (-1: no match yet)
    for n in range(min(n_max, width - 1), n_min - 1, -1):
        todo = (start < 0) & (lens > n)
        if not todo.any():
            break
        idx = rows[todo]
        suffix = tokens[idx[:, None], lens[idx, None] - n + np.arange(n)]  # [b, n]
        windows = sliding_window_view(tokens[idx, :width], n, axis=1)  # [b, width - n + 1, n]
        match = (windows == suffix[:, None, :]).all(axis=2)
        positions = np.arange(windows.shape[1])
        match &= positions[None, :] + n < lens[idx, None]  # a continuation exists (excludes the tail itself)
        found = match.any(axis=1)
        # The earliest match: its continuation is the longest (a loop's newest match is cut by the end).
        first = np.argmax(match, axis=1)
        start[idx[found]] = first[found] + n
    drafts: list[list[int]] = []
    for i, st in enumerate(start.tolist()):
        if st < 0:
            drafts.append([])
            continue
        stop = min(st + k, int(lens[i]))
        drafts.append(tokens[i, st:stop].tolist())
    return drafts
