"""Turns a ``SchedulerOutput`` into flat tensors, runs the model over the paged KV cache, samples and
verifies drafts, and returns a ``RunnerOutput``: values in, values out, no live request objects.
On CUDA, decode steps and verify steps (a decode with drafts) replay CUDA graphs captured for a ladder of
token counts: a verify step is laid out as one single-query "decode row" per token (its causal prefix as
its sequence length), so the graphed decode shape carries several query tokens per request."""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from kvloom.core.attention import AttentionMetadata
from kvloom.core.engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput
from kvloom.core.sampler import PromptScores, SampleResult, Sampler, score_prompt

logger = logging.getLogger("kvloom")


def graph_batch_sizes(max_num_seqs: int, verify_width: int = 1, max_verify_seqs: int = 0) -> list[int]:
    """Token counts to capture: 1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself);
    with speculation (``verify_width`` = k + 1 tokens per request), also ``b * verify_width`` for that
    ladder's sizes ``b`` up to ``max_verify_seqs``, so a verify batch pads little."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    if verify_width > 1 and max_verify_seqs:
        sizes += [b * verify_width for b in graph_batch_sizes(min(max_verify_seqs, max_num_seqs))]
    return sorted(set(sizes))


def batch_order(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The order of a flat step's sequences: single-query ones (decodes) first, else as planned."""
    return sorted(seqs, key=lambda s: s.num_new_tokens != 1)


def decode_layout(seqs: list[ScheduledSeq]) -> bool:
    """Whether a step can run as single-query rows: every sequence is one token (a decode, or a
    one-token chunk) or samples every token it feeds (a decode with drafts to verify)."""
    return all(s.num_new_tokens == 1 or s.num_sample_rows == s.num_new_tokens for s in seqs)


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Run eager verify steps as single-query rows too (what the graphs do; on by default where
        # graphs are captured, and for tests of that layout on the CPU).
        self.verify_as_decodes = False
        self._pin = device.type == "cuda"
        # The previous step's sampled tokens on the device, and each request's row in them: inputs that
        # are still placeholders on the host are filled from here without waiting for the copy back.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # Called with a step's sequences once its forward is launched and before it samples: the engine
        # fills grammar masks there, on the host while the GPU runs the forward.
        self.before_sampling: Callable[[list[ScheduledSeq]], None] | None = None

    # --- inputs --------------------------------------------------------------------------------
    def _host_inputs(self, order: list[ScheduledSeq]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []  # positions that score prompt tokens, ahead of the sampled rows
        for s in order:
            n = len(s.token_ids)
            if s.prompt_targets:
                prompt_rows.extend(range(query_start[-1], query_start[-1] + len(s.prompt_targets)))
            start, end = s.start_pos, s.start_pos + n
            input_ids.extend(s.token_ids)
            positions.extend(range(start, end))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            logits_rows.extend(range(query_start[-1] - s.num_sample_rows, query_start[-1]))
        max_blocks = max(len(s.block_ids) for s in order)
        table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in order]
        return input_ids, positions, slots, query_start, seq_lens, query_lens, prompt_rows + logits_rows, table

    def _decode_rows(self, seqs: list[ScheduledSeq]):
        """Host inputs of a step in the decode layout: one row per token, whose sequence length is its
        position + 1 and whose block table is its request's (so each draft attends causally); the
        rows to sample are every sampling sequence's tokens."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        tables: list[list[int]] = []
        for s in seqs:
            if s.samples:
                rows.extend(range(len(ids), len(ids) + s.num_new_tokens))
            blocks = s.block_ids
            for i, t in enumerate(s.token_ids):
                p = s.start_pos + i
                ids.append(max(t, 0))
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
                tables.append(blocks)
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]
        return ids, pos, slots, [p + 1 for p in pos], table, rows

    def _prepare_decode_rows(self, seqs: list[ScheduledSeq]):
        ids, pos, slots, seq_lens, table, rows = self._decode_rows(seqs)
        n = len(ids)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots, torch.int64), block_tables=self._to_device(table, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            query_start_loc=self._to_device(list(range(n + 1)), torch.int32),
            num_decodes=n, max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=[1] * n, seq_lens_cpu=seq_lens,
        )
        ids_dev = self._to_device(ids, torch.int64)
        self._fill_placeholders(seqs, ids_dev)
        return ids_dev, self._to_device(pos, torch.int64), meta, self._to_device(rows, torch.int64), \
            [s for s in seqs if s.samples]

    def _to_device(self, data, dtype) -> torch.Tensor:
        # Through numpy: about 3x faster than torch.tensor on a list (a 256 x 48 block table: 0.3 against
        # 0.9 ms), which is host time of every step.
        t = torch.from_numpy(np.asarray(data, dtype=_NUMPY_DTYPES[dtype]))
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare(self, seqs: list[ScheduledSeq]):
        """Flat inputs for one step; sequences with a single query (decodes) come first. The rows to keep
        are the positions that score prompt tokens (``prompt_targets``), then the rows to sample."""
        order = batch_order(seqs)
        ids, pos, slots, qsl, seq_lens, query_lens, rows, table = self._host_inputs(order)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(table, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            query_start_loc=self._to_device(qsl, torch.int32),
            num_decodes=sum(1 for q in query_lens if q == 1),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        sampling = [s for s in order if s.samples]
        ids_dev = self._to_device([max(t, 0) for t in ids], torch.int64)
        self._fill_placeholders(order, ids_dev)
        return ids_dev, self._to_device(pos, torch.int64), meta, self._to_device(rows, torch.int64), sampling

    # --- execution -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> "LaunchedStep":
        """Queue one step on the device and return at once; ``fetch()`` on the result waits for it and
        gives the ``RunnerOutput``."""
        self.sampler.remove(plan.finished_request_ids)
        seqs = plan.seqs
        # Prompt logprobs need logits at prompt positions, which only the eager flat layout keeps.
        scoring = [s for s in batch_order(seqs) if s.prompt_targets] if any(s.prompt_targets for s in seqs) else []
        prompt = None
        if not scoring and self.graphs and plan.num_tokens <= self._max_graph_batch and decode_layout(seqs):
            logits, sampling = self._replay(seqs)
        else:
            as_decodes = not scoring and self.verify_as_decodes and plan.num_draft_tokens and decode_layout(seqs)
            ids, pos, meta, rows, sampling = (self._prepare_decode_rows if as_decodes else self.prepare)(seqs)
            hidden = self.model(ids, pos, meta, self.kv_caches, keep=rows)  # the kept rows' states
            if scoring:
                num_scored = sum(len(s.prompt_targets) for s in scoring)
                prompt = score_prompt(hidden[:num_scored], scoring, self.model.compute_logits)
                prompt.start_copy()
                hidden = hidden[num_scored:]
            logits = self.model.compute_logits(hidden) if sampling else None
        if not sampling:
            self._prev_tokens, self._prev_rows = None, {}
            return LaunchedStep(None, prompt)
        if self.before_sampling is not None:
            self.before_sampling(sampling)
        result = self.sampler.sample(logits, sampling)
        result.start_copy()
        self._prev_tokens = result.tokens
        self._prev_rows = {}
        row = 0
        for s in sampling:
            self._prev_rows[s.request_id] = row + s.num_sample_rows - 1
            row += s.num_sample_rows
        return LaunchedStep(result, prompt)

    def _fill_placeholders(self, order: list[ScheduledSeq], ids_dev: torch.Tensor) -> None:
        """Replace placeholder inputs with the previous step's sampled tokens, on the device. Only a
        request's newest known token can be one (async steps verify no drafts)."""
        dst, src = [], []
        offset = 0
        for s in order:
            if s.num_placeholders:
                row = self._prev_rows.get(s.request_id)
                if row is None or self._prev_tokens is None or s.num_placeholders > 1:
                    raise RuntimeError(f"request {s.request_id!r} has {s.num_placeholders} unresolved tokens "
                                       "that the previous step did not sample")
                dst.append(offset + s.num_new_tokens - len(s.draft_token_ids) - 1)
                src.append(row)
            offset += s.num_new_tokens
        if dst:
            dst_t = self._to_device(dst, torch.int64)
            src_t = self._to_device(src, torch.int64)
            ids_dev.index_copy_(0, dst_t, self._prev_tokens.index_select(0, src_t))

    # --- CUDA graphs ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_width: int = 1,
                       max_verify_seqs: int = 0) -> None:
        """Capture one graph per token count of a decode-layout step (model forward + logits), largest
        first so the smaller ones reuse its memory pool."""
        self.verify_as_decodes = True
        sizes = graph_batch_sizes(max_num_seqs, verify_width, max_verify_seqs)
        max_b = sizes[-1]
        max_blocks = -(-max_model_len // self.block_size)
        dev = self.device
        self._static = {
            "ids": torch.zeros(max_b, dtype=torch.int64, device=dev),
            "pos": torch.zeros(max_b, dtype=torch.int64, device=dev),
            "slots": torch.full((max_b,), -1, dtype=torch.int64, device=dev),
            "table": torch.zeros(max_b, max_blocks, dtype=torch.int32, device=dev),
            "seq_lens": torch.zeros(max_b, dtype=torch.int32, device=dev),
            "qsl": torch.arange(max_b + 1, dtype=torch.int32, device=dev),
        }
        self._max_graph_batch = max_b
        self._max_model_len = max_model_len
        self._logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for b in reversed(sizes):
            meta = self._static_meta(b)
            s = self._static
            for _ in range(2):  # warm up (Triton autotune/compile) outside the capture
                self.model.compute_logits(self.model(s["ids"][:b], s["pos"][:b], meta, self.kv_caches))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(s["ids"][:b], s["pos"][:b], meta, self.kv_caches)
                self._logits[b] = self.model.compute_logits(hidden)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d decode-layout token counts (1..%d) in %.1fs",
                    len(sizes), max_b, time.perf_counter() - t0)

    def _static_meta(self, b: int) -> AttentionMetadata:
        s = self._static
        return AttentionMetadata(
            slot_mapping=s["slots"][:b], block_tables=s["table"][:b], seq_lens=s["seq_lens"][:b],
            query_start_loc=s["qsl"][: b + 1], num_decodes=b, max_query_len=1,
            max_seq_len=self._max_model_len, query_lens_cpu=[1] * b, seq_lens_cpu=[self._max_model_len] * b,
        )

    def _replay(self, seqs: list[ScheduledSeq]):
        ids, pos, slots, seq_lens, table, rows = self._decode_rows(seqs)
        n = len(ids)
        b = next(size for size in sorted(self.graphs) if size >= n)
        pad = b - n
        s = self._static
        s["ids"][:b].copy_(self._to_device(ids + [0] * pad, torch.int64), non_blocking=True)
        self._fill_placeholders(seqs, s["ids"])
        s["pos"][:b].copy_(self._to_device(pos + [0] * pad, torch.int64), non_blocking=True)
        s["slots"][:b].copy_(self._to_device(slots + [-1] * pad, torch.int64), non_blocking=True)
        s["seq_lens"][:b].copy_(self._to_device(seq_lens + [0] * pad, torch.int32), non_blocking=True)
        width = len(table[0])
        s["table"][:n, :width].copy_(self._to_device(table, torch.int32), non_blocking=True)
        self.graphs[b].replay()
        logits = self._logits[b][:n] if len(rows) == n else self._logits[b][self._to_device(rows, torch.int64)]
        return logits, [sc for sc in seqs if sc.samples]


class LaunchedStep:
    """A launched step: ``fetch()`` waits for its tokens and returns them as a ``RunnerOutput`` (the same
    one each time: structured outputs take a step's tokens before the engine applies them)."""

    def __init__(self, sample: SampleResult | None, prompt: PromptScores | None = None) -> None:
        self.sample = sample
        self.prompt = prompt
        self._output: RunnerOutput | None = None

    def fetch(self) -> RunnerOutput:
        if self._output is None:
            prompt = self.prompt.fetch() if self.prompt is not None else {}
            if self.sample is None:
                self._output = RunnerOutput(prompt_logprobs=prompt)
            else:
                sampled, logprobs = self.sample.fetch()
                self._output = RunnerOutput(sampled, logprobs, prompt)
        return self._output
