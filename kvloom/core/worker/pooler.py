"""Pooling requests' share of a step: the kept rows of their final hidden states summed per request (or,
for a yes/no scorer, the logits of its tokens at the last position), copied to the host with the step."""

from __future__ import annotations

import numpy as np
import torch

from kvloom.core.engine.step import PooledChunk, ScheduledSeq


def pooled_row_ranges(order: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence of a step (in its flat order), the first row of its chunk that pooling keeps and how
    many (0 for generating sequences)."""
    firsts, counts = [], []
    for s in order:
        first, count = s.pooling.rows(s.start_pos, s.num_new_tokens, s.num_sample_rows > 0) \
            if s.pooling is not None else (0, 0)
        firsts.append(first)
        counts.append(count)
    return np.asarray(firsts, np.int64), np.asarray(counts, np.int64)


class PooledStates:
    """Launched with a step: ``hidden`` holds the pooling sequences' kept rows, in their order."""

    def __init__(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, compute_logits) -> None:
        self.parts: list[tuple[str, int, int, torch.Tensor]] = []
        row = 0
        for s in seqs:
            _, count = s.pooling.rows(s.start_pos, s.num_new_tokens, s.num_sample_rows > 0)
            if not count:
                continue
            rows = hidden[row: row + count]
            row += count
            if s.pooling.score_token_ids:
                ids = torch.tensor(s.pooling.score_token_ids, device=rows.device)
                vector = compute_logits(rows[-1:])[0].index_select(0, ids)
            else:
                vector = rows.float().sum(0)
            self.parts.append((s.request_id, s.start_pos, count, vector.to("cpu", non_blocking=True)))
        self.event = None
        if hidden.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def fetch(self) -> dict[str, PooledChunk]:
        if self.event is not None:
            self.event.synchronize()  # the non-blocking copies to the host are done
        return {rid: PooledChunk(start, count, vector) for rid, start, count, vector in self.parts}
