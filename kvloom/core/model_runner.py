"""Turns a scheduler plan into flat tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

import torch

from kvloom.core.attention import AttentionMetadata
from kvloom.core.messages import TokenLogprobs
from kvloom.core.sampler import Sampler
from kvloom.core.scheduler import ScheduledRequest, SchedulerPlan


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)

    def prepare(self, scheduled: list[ScheduledRequest]):
        """Flat inputs for one step; sequences with a single query (decodes) come first."""
        bs = self.block_size
        order = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        for s in order:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + s.num_new_tokens)
            seq_lens.append(end)
            query_lens.append(s.num_new_tokens)
            if s.samples:
                logits_rows.append(query_start[-1] - 1)
        max_blocks = max(len(s.request.block_ids) for s in order)
        table = torch.zeros(len(order), max_blocks, dtype=torch.int32)
        for i, s in enumerate(order):
            table[i, : len(s.request.block_ids)] = torch.tensor(s.request.block_ids, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            num_decodes=sum(1 for q in query_lens if q == 1),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        rows = torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True)
        sampling = [s for s in order if s.samples]
        return ids, pos, meta, rows, sampling

    @torch.inference_mode()
    def execute(self, plan: SchedulerPlan) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """Run one step; returns the sampled token ids (and logprobs, where asked) per request id."""
        ids, pos, meta, rows, sampling = self.prepare(plan.scheduled)
        hidden = self.model(ids, pos, meta, self.kv_caches)
        if not sampling:
            return {}, {}
        logits = self.model.compute_logits(hidden[rows])
        requests = [s.request for s in sampling]
        tokens, logprobs = self.sampler(logits, requests)
        sampled = {r.request_id: [t] for r, t in zip(requests, tokens)}
        lps = {r.request_id: [lp] for r, lp in zip(requests, logprobs) if lp is not None}
        return sampled, lps
