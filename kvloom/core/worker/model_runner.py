"""Turns a ``SchedulerOutput`` into flat tensors, runs the model over the paged KV cache, samples and
verifies drafts, and returns a ``RunnerOutput``: values in, values out, no live request objects.
On CUDA, decode steps and verify steps (a decode with drafts) replay CUDA graphs captured for a ladder of
token counts: a verify step is laid out as one single-query "decode row" per token (its causal prefix as
its sequence length), so the graphed decode shape carries several query tokens per request."""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from kvloom.core.engine.step import RunnerOutput, ScheduledSeq, SchedulerOutput
from kvloom.core.model.attention.base import AttentionMetadata
from kvloom.core.model.lora import host_segments
from kvloom.core.worker.pooler import PooledStates, pooled_row_ranges
from kvloom.core.worker.sampler import PromptScores, Sampler, SampleResult, score_prompt

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


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}
# Offsets of the arrays in a step's staged buffer: aligned as the caching allocators align whole tensors,
# so kernels see the pointer alignment (and Triton the specializations) that separate tensors had.
_STAGE_ALIGN = 256


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``range(starts[i], starts[i] + lens[i])`` for each i, concatenated (int64)."""
    total = int(lens.sum())
    ends = np.cumsum(lens)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lens), lens)


def _every_row(rows: np.ndarray, num_rows: int) -> bool:
    """Whether the rows to keep are every row in order. Only the host can tell: rows scoring prompt tokens
    come first, so a step may keep as many rows as it has in another order."""
    return len(rows) == num_rows and bool((rows == np.arange(num_rows)).all())


def _check_blocks(seqs: list[ScheduledSeq], ends: np.ndarray, block_size: int) -> int:
    """The widest block table of a step, after checking that each sequence's blocks hold its positions
    (a plan that does not would write another request's cache slots)."""
    num_blocks = np.fromiter([len(s.block_ids) for s in seqs], np.int64, len(seqs))
    short = np.flatnonzero(ends > num_blocks * block_size)
    if len(short):
        s = seqs[short[0]]
        raise ValueError(f"request {s.request_id!r} feeds positions up to {int(ends[short[0]]) - 1} with "
                         f"{len(s.block_ids)} blocks of {block_size} tokens")
    return int(num_blocks.max())


def _padded(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    out = np.full(n, fill, dtype=a.dtype)
    out[: len(a)] = a
    return out


def make_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   layout=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache of ``shape``. In a hybrid layout (``kv_layout.KVLayout``) the layers in the
    same place of different groups share one pair of tensors: a block id is a page across the groups' layers,
    and whichever group holds the block writes it."""
    if layout is None or not layout.hybrid:
        return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(num_layers)]
    pages = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(layout.slots)]
    return [pages[slot] for slot in layout.slot_of_layer()]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU, anonymous mapped memory: zero pages that become resident only
    when a block is first written, so the reserve costs the memory that requests use, not its full size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class _Tokens(NamedTuple):
    ids: np.ndarray  # per token
    positions: np.ndarray
    slots: np.ndarray
    counts: np.ndarray  # per sequence: tokens fed
    ends: np.ndarray  # per sequence: its length after the step
    rows: np.ndarray  # per sequence: its row in BlockTables.array
    token_rows: np.ndarray  # per token: its sequence's row
    width: int  # the widest block table of the step
    groups: list  # a hybrid KV cache's other layer groups: (slots, rows, token_rows) each
    lora_slots: np.ndarray | None  # per token: its adapter's device slot (-1: the base); None without LoRA


class BlockTables:
    """Each request's block table as a row of one numpy array kept from step to step, so a step writes a
    request's blocks only where they changed since its last step (a new block every ``block_size``
    tokens, or a new table after a preemption) instead of converting every table of the batch from
    Python lists every step. Entries past a request's blocks are 0, a valid block, as the padding of
    a step's table always was. Rows of finished requests go back through ``release``; a runner that
    is never told (a draft model's) drops the rows of requests absent from a step once they pile up."""

    def __init__(self, group: int = 0) -> None:
        self.group = group  # the layer group whose tables these are (a hybrid KV cache has several)
        self.array = np.zeros((64, 64), dtype=np.int32)
        self._row: dict[str, int] = {}
        self._held: dict[str, list[int]] = {}  # the block list each row holds (a plan's copy, never mutated)
        self._free = list(range(len(self.array) - 1, -1, -1))

    def release(self, request_ids) -> None:
        for rid in request_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self.array[row, : len(self._held.pop(rid))] = 0
                self._free.append(row)

    def rows(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Each sequence's row, its request's current blocks written in."""
        if len(self._row) > 2 * len(seqs) + 512:
            live = {s.request_id for s in seqs}
            self.release([rid for rid in self._row if rid not in live])
        row_of, held_of, group = self._row, self._held, self.group
        out = []
        for s in seqs:
            rid, blocks = s.request_id, s.block_ids if group == 0 else s.extra_block_ids[group - 1]
            row = row_of.get(rid)
            if row is None:
                row = self._new_row(rid)
                held = []
            else:
                held = held_of[rid]
            if blocks is not held and blocks != held:
                k = len(held)
                if len(blocks) > k and blocks[:k] == held:
                    self._write(row, k, blocks)  # new blocks at the end
                else:
                    self._write(row, 0, blocks, clear=k)
                held_of[rid] = blocks
            out.append(row)
        return np.array(out, dtype=np.int64)

    def _new_row(self, rid: str) -> int:
        if not self._free:
            n = len(self.array)
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._row[rid] = self._free.pop()
        self._held[rid] = []
        return row

    def _write(self, row: int, start: int, blocks: list[int], clear: int = 0) -> None:
        if len(blocks) > self.array.shape[1]:
            width = max(len(blocks), 2 * self.array.shape[1])
            self.array = np.pad(self.array, ((0, 0), (0, width - self.array.shape[1])))
        if clear > len(blocks):
            self.array[row, len(blocks): clear] = 0
        self.array[row, start: len(blocks)] = blocks[start:]


class ModelRunner:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, seed: int = 0, num_kv_groups: int = 1, lora=None) -> None:
        """``num_kv_groups``: layer groups of a hybrid KV cache, each with its own block tables (the model's
        ``kv_groups`` says which layer reads which); a step then gives the model one metadata per group."""
        self.model = model
        self.lora = lora  # the LoRA adapter pool (kvloom.core.model.lora.LoRAPool), when serving adapters
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Run eager verify steps as single-query rows too (what the graphs do; on by default where
        # graphs are captured, and for tests of that layout on the CPU).
        self.verify_as_decodes = False
        self._pin = device.type == "cuda"
        self.block_tables = BlockTables()
        self.group_tables = [BlockTables(g) for g in range(1, num_kv_groups)]
        self.stage_in_one_copy = device.type != "cpu"  # see _stage; tests turn it on for the CPU
        # The previous step's sampled tokens on the device, and each request's row in them: inputs that
        # are still placeholders on the host are filled from here without waiting for the copy back.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # Called with a step's sequences once its forward is launched and before it samples: the engine
        # fills grammar masks there, on the host while the GPU runs the forward.
        self.before_sampling: Callable[[list[ScheduledSeq]], None] | None = None
        self.compiled_decode = None  # on the CPU: runs decode-only steps (kvloom.core.worker.cpu_compile)
        self.compiled_prompts = None  # on the CPU: runs the other steps (with prompt rows), as far as it can

    # --- inputs --------------------------------------------------------------------------------
    def _tokens(self, seqs: list[ScheduledSeq]) -> _Tokens:
        """What both layouts take per token (ids, placeholders as 0; positions; cache slots) and per sequence (token count,
        end, block-table row), after checking that each sequence's blocks hold its positions."""
        bs = self.block_size
        counts = np.fromiter([len(s.token_ids) for s in seqs], np.int64, len(seqs))
        starts = np.fromiter([s.start_pos for s in seqs], np.int64, len(seqs))
        ends = starts + counts
        width = _check_blocks(seqs, ends, bs)
        rows = self.block_tables.rows(seqs)
        positions = _ranges(starts, counts)
        token_rows = np.repeat(rows, counts)
        slots = self.block_tables.array[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        ids = np.fromiter([t for s in seqs for t in s.token_ids], np.int64, len(positions))
        np.maximum(ids, 0, out=ids)  # placeholders: filled on the device
        groups = []
        for tables in self.group_tables:  # the same positions, each group's own blocks
            g_rows = tables.rows(seqs)
            g_token_rows = np.repeat(g_rows, counts)
            g_slots = tables.array[g_token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            groups.append((g_slots, g_rows, g_token_rows))
        lora_slots = None
        if self.lora is not None:
            lora_slots = np.repeat(np.fromiter([s.lora_slot for s in seqs], np.int64, len(seqs)), counts)
        return _Tokens(ids, positions, slots, counts, ends, rows, token_rows, width, groups, lora_slots)

    def _group_inputs(self, t: _Tokens, per_token: bool) -> list[tuple[object, type]]:
        """``_stage`` arguments of the other layer groups: each one's slots, then its table (per sequence, or
        per token in the decode layout)."""
        out = []
        for tables, (g_slots, g_rows, g_token_rows) in zip(self.group_tables, t.groups):
            out += [(g_slots, np.int64), (tables.array[g_token_rows if per_token else g_rows, : t.width], np.int32)]
        return out

    @staticmethod
    def _group_metas(meta: AttentionMetadata, staged: list[torch.Tensor]):
        """The step's metadata, as a list of one per layer group where there are several."""
        if not staged:
            return meta
        return [meta] + [dataclasses.replace(meta, slot_mapping=staged[i], block_tables=staged[i + 1])
                         for i in range(0, len(staged), 2)]

    def _host_inputs(self, order: list[ScheduledSeq]):
        """A flat step's host inputs as numpy arrays: ids, positions, cache slots, query start offsets,
        sequence lengths, query lengths, the rows to keep (prompt-scoring positions, then the sampled
        rows) and the block table."""
        t = self._tokens(order)
        query_start = np.zeros(len(order) + 1, np.int64)
        np.cumsum(t.counts, out=query_start[1:])
        num_sample = np.fromiter([s.num_sample_rows if s.pooling is None else 0 for s in order], np.int64,
                                 len(order))
        keep = _ranges(query_start[1:] - num_sample, num_sample)
        if any(s.pooling is not None for s in order):  # pooled rows (prefill-only requests), ahead of the sampled
            firsts, counts = pooled_row_ranges(order)
            keep = np.concatenate([_ranges(query_start[:-1] + firsts, counts), keep])
        if any(s.prompt_targets for s in order):  # positions that score prompt tokens, ahead of the sampled rows
            scored = np.fromiter([len(s.prompt_targets or ()) for s in order], np.int64, len(order))
            keep = np.concatenate([_ranges(query_start[:-1], scored), keep])
        table = self.block_tables.array[t.rows, : t.width]
        return (t.ids, t.positions, t.slots, query_start, t.ends, t.counts, keep, table, self._group_inputs(t, False),
                t.lora_slots)

    def _decode_rows(self, seqs: list[ScheduledSeq]):
        """Host inputs of a step in the decode layout (numpy arrays): one row per token, whose sequence
        length is its position + 1 and whose block table is its request's (so each draft attends
        causally); the rows to sample are every sampling sequence's tokens."""
        t = self._tokens(seqs)
        sampled = np.fromiter([s.samples for s in seqs], bool, len(seqs))
        offsets = np.cumsum(t.counts) - t.counts  # each sequence's first row
        rows = _ranges(offsets[sampled], t.counts[sampled])
        table = self.block_tables.array[t.token_rows, : t.width]
        return t.ids, t.positions, t.slots, t.positions + 1, table, rows, self._group_inputs(t, True), t.lora_slots

    def _prepare_decode_rows(self, seqs: list[ScheduledSeq]):
        ids, pos, slots, seq_lens, table, rows, groups, lora_slots = self._decode_rows(seqs)
        n = len(ids)
        every = _every_row(rows, n)
        lora = self._lora_arrays(lora_slots, None if every else rows)
        ids_t, pos_t, slots_t, table_t, lens_t, qsl_t, rows_t, dst, src, *staged = self._stage(
            (ids, np.int64), (pos, np.int64), (slots, np.int64), (table, np.int32), (seq_lens, np.int32),
            (np.arange(n + 1), np.int32), (rows, np.int64), *self._placeholders(seqs), *groups,
            *self._lora_stage(lora))
        staged, lora_t = staged[: len(groups)], staged[len(groups):]  # the groups' slots and tables, then LoRA's
        lens = seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slots_t, block_tables=table_t, seq_lens=lens_t, query_start_loc=qsl_t,
            num_decodes=n, max_query_len=1, max_seq_len=max(lens), query_lens_cpu=[1] * n, seq_lens_cpu=lens,
        )
        self._fill_placeholders(ids_t, dst, src)
        return (ids_t, pos_t, self._group_metas(meta, staged), None if every else rows_t,
                [s for s in seqs if s.samples], self._lora_batch(lora, lora_t))

    # --- LoRA ----------------------------------------------------------------------------------
    def _lora_arrays(self, lora_slots: np.ndarray | None, keep: np.ndarray | None):
        """A step's LoRA grouping on the host (``LoRAPool.host_arrays``), or None for a step on the base."""
        return None if lora_slots is None else self.lora.host_arrays(lora_slots, keep)

    @staticmethod
    def _lora_stage(lora) -> list[tuple[np.ndarray, type]]:
        if lora is None:
            return []
        arrays, _, kept = lora
        return [(a, np.int32) for a in (*arrays, *(kept[0] if kept is not None else ()))]

    def _lora_batch(self, lora, tensors: list[torch.Tensor]):
        if lora is None:
            return None
        _, spans, kept = lora
        return self.lora.make_batch(tensors, spans, kept[1] if kept is not None else None)

    def load_adapters(self, loads) -> None:
        """Start filling the device slots a plan names (``LoRALoad``s)."""
        for load in loads:
            self.lora.load(load.slot, load.adapter_id, load.name, load.path)

    def _stage(self, *arrays: tuple[object, type]) -> list[torch.Tensor]:
        """A step's integer inputs on the device: each ``(values, numpy dtype)`` (a list, a list of equal
        rows or a range) is written into one host buffer, which reaches the device in one pinned,
        non-blocking copy; each tensor is a view of it. One copy instead of one per array: each copy costs
        the host a pinned allocation, a copy call and an event, every step. On the CPU nothing is copied
        and each array stays its own tensor (``stage_in_one_copy`` off: there the views of one buffer cost
        more than they save; tests turn it on to run the CUDA path's layout)."""
        parts = [np.asarray(values, dtype=dtype) for values, dtype in arrays]
        if not self.stage_in_one_copy:
            return [torch.from_numpy(a) for a in parts]
        offsets, total = [], 0
        for a in parts:
            offsets.append(total)
            total += -(-a.nbytes // _STAGE_ALIGN) * _STAGE_ALIGN
        host = torch.empty(max(total, _STAGE_ALIGN), dtype=torch.uint8, pin_memory=self._pin)
        buf = host.numpy()
        for a, off in zip(parts, offsets):
            buf[off: off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        dev = host.to(self.device, non_blocking=True) if host.device != self.device else host
        return [dev[off: off + a.nbytes].view(_TORCH_DTYPES[a.dtype.type]).view(a.shape)
                for a, off in zip(parts, offsets)]

    def prepare(self, seqs: list[ScheduledSeq]):
        """Flat inputs for one step; sequences with a single query (decodes) come first. The rows to keep
        are the positions that score prompt tokens (``prompt_targets``), then the rows to sample."""
        order = batch_order(seqs)
        ids, pos, slots, qsl, seq_lens, query_lens, rows, table, groups, lora_slots = self._host_inputs(order)
        every = _every_row(rows, len(ids))
        lora = self._lora_arrays(lora_slots, None if every else rows)
        ids_t, pos_t, slots_t, table_t, lens_t, qsl_t, rows_t, dst, src, *staged = self._stage(
            (ids, np.int64), (pos, np.int64), (slots, np.int64), (table, np.int32), (seq_lens, np.int32),
            (qsl, np.int32), (rows, np.int64), *self._placeholders(order), *groups, *self._lora_stage(lora))
        staged, lora_t = staged[: len(groups)], staged[len(groups):]
        query_lens, seq_lens = query_lens.tolist(), seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slots_t, block_tables=table_t, seq_lens=lens_t, query_start_loc=qsl_t,
            num_decodes=sum(1 for q in query_lens if q == 1),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        sampling = [s for s in order if s.samples and s.pooling is None]
        self._fill_placeholders(ids_t, dst, src)
        return (ids_t, pos_t, self._group_metas(meta, staged), None if every else rows_t, sampling,
                self._lora_batch(lora, lora_t))

    # --- execution -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> "LaunchedStep":
        """Queue one step on the device and return at once; ``fetch()`` on the result waits for it and
        gives the ``RunnerOutput``."""
        self.sampler.remove(plan.finished_request_ids)
        self.block_tables.release(plan.finished_request_ids)
        for tables in self.group_tables:
            tables.release(plan.finished_request_ids)
        if plan.lora_loads:
            self.load_adapters(plan.lora_loads)
        seqs = plan.seqs
        if not seqs:  # only adapter loads: the previous step's tokens stay where the next one looks
            return LaunchedStep(None)
        # Prompt logprobs need logits at prompt positions, which only the eager flat layout keeps.
        scoring = [s for s in batch_order(seqs) if s.prompt_targets] if any(s.prompt_targets for s in seqs) else []
        # Pooling requests keep prompt rows too (never sampled), so they also take the eager flat layout.
        pooling = [s for s in batch_order(seqs) if s.pooling is not None] if any(s.pooling for s in seqs) else []
        prompt = pooled = None
        if not scoring and not pooling and self.graphs and plan.num_tokens <= self._max_graph_batch \
                and decode_layout(seqs):
            logits, sampling = self._replay(seqs)
        else:
            as_decodes = (not scoring and not pooling and self.verify_as_decodes and plan.num_draft_tokens
                          and decode_layout(seqs))
            ids, pos, meta, rows, sampling, lora = (self._prepare_decode_rows if as_decodes else self.prepare)(seqs)
            if (self.compiled_decode is not None and not scoring and not pooling and rows is None
                    and all(s.num_new_tokens == 1 for s in seqs)):  # one token each: no drafts either
                hidden = self.compiled_decode(ids, pos, meta)
            elif self.compiled_prompts is not None and not scoring and not pooling:
                hidden = self.compiled_prompts(ids, pos, meta, rows)
            else:
                hidden = self.model(ids, pos, meta, self.kv_caches, keep=rows, lora=lora)  # the kept rows' states
            if scoring:
                num_scored = sum(len(s.prompt_targets) for s in scoring)
                prompt = score_prompt(hidden[:num_scored], scoring, self.model.compute_logits)
                prompt.start_copy()
                hidden = hidden[num_scored:]
            if pooling:
                num_pooled = int(pooled_row_ranges(pooling)[1].sum())
                pooled = PooledStates(pooling, hidden[:num_pooled], self.model.compute_logits)
                hidden = hidden[num_pooled:]
            logits = self.model.compute_logits(hidden) if sampling else None
        if not sampling:
            self._prev_tokens, self._prev_rows = None, {}
            return LaunchedStep(None, prompt, pooled)
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
        return LaunchedStep(result, prompt, pooled)

    def _placeholders(self, order: list[ScheduledSeq]) -> tuple[tuple[list[int], type], tuple[list[int], type]]:
        """Where a step's placeholder inputs are in its flat ids, and the previous step's sampled rows that
        hold their tokens (as ``_stage`` arguments). Only a request's newest known token can be one (async
        steps verify no drafts)."""
        dst, src = [], []
        offset = 0
        prev_rows = self._prev_rows
        for s in order:
            if s.num_placeholders:
                row = prev_rows.get(s.request_id)
                if row is None or self._prev_tokens is None or s.num_placeholders > 1:
                    raise RuntimeError(f"request {s.request_id!r} has {s.num_placeholders} unresolved tokens "
                                       "that the previous step did not sample")
                dst.append(offset + s.num_new_tokens - len(s.draft_token_ids) - 1)
                src.append(row)
            offset += s.num_new_tokens
        return (dst, np.int64), (src, np.int64)

    def _fill_placeholders(self, ids_dev: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Replace placeholder inputs with the previous step's sampled tokens, on the device."""
        if len(dst):
            ids_dev.index_copy_(0, dst, self._prev_tokens.index_select(0, src))

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
        for g in range(1, len(self.group_tables) + 1):  # a hybrid cache's other layer groups
            self._static[f"slots{g}"] = torch.full((max_b,), -1, dtype=torch.int64, device=dev)
            self._static[f"table{g}"] = torch.zeros(max_b, max_blocks, dtype=torch.int32, device=dev)
        self._max_graph_batch = max_b
        self._max_model_len = max_model_len
        # With adapters every graph runs the LoRA kernels, over static buffers that each replay fills.
        lora = self.lora.static_batch(max_b) if self.lora is not None else None
        self._logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for b in reversed(sizes):
            meta = self._static_meta(b)
            s = self._static
            for _ in range(2):  # warm up (Triton autotune/compile) outside the capture
                self.model.compute_logits(self.model(s["ids"][:b], s["pos"][:b], meta, self.kv_caches, lora=lora))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(s["ids"][:b], s["pos"][:b], meta, self.kv_caches, lora=lora)
                self._logits[b] = self.model.compute_logits(hidden)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d decode-layout token counts (1..%d) in %.1fs",
                    len(sizes), max_b, time.perf_counter() - t0)

    def compile_cpu_steps(self, max_num_seqs: int, adjust_threads=None, threads: int = 1) -> None:
        """On the CPU: compile the decode step (``kvloom.core.worker.cpu_compile``) now, for every batch size
        at ``threads`` threads, and the steps holding prompts (unless ``KVLOOM_CPU_COMPILE_PROMPTS=0``), or say in
        the log why they stay eager. ``adjust_threads()``: the thread governor's check, run before each compiled
        step (its layer hooks do not run inside the graph)."""
        from kvloom.core.worker.cpu_compile import CompiledDecode, CompiledPrompts, compile_refusal
        from kvloom.kernels import cpu_native

        backend = self.model.layers[0].self_attn.backend if hasattr(self.model, "layers") else None
        refusal = compile_refusal(self.model, backend, self.kv_caches, self.lora)
        if refusal is not None:
            logger.info("CPU steps eager: %s", refusal)
            return
        t0 = time.perf_counter()
        cpu_native.load()  # the per-layer ops dispatched in C++ (built once a machine)
        compiled = CompiledDecode(self.model, backend, self.kv_caches, adjust_threads)
        seconds = time.perf_counter() - t0 + compiled.warm_up(max_num_seqs, self.block_size, self._scratch_meta,
                                                              threads)
        self.compiled_decode = compiled
        if os.environ.get("KVLOOM_CPU_COMPILE_PROMPTS", "1") != "0":
            prompts = CompiledPrompts(self.model, backend, self.kv_caches, adjust_threads)
            try:
                seconds += prompts.warm_up(self.block_size, lambda n, length: self._scratch_meta(n, length, length),
                                           threads)
                self.compiled_prompts = prompts
            except Exception as exc:  # noqa: BLE001 - the decode steps stay compiled, prompt steps run as before
                logger.warning("CPU steps holding prompts stay eager: compiling them failed (%s: %s)",
                               type(exc).__name__, exc)
        logger.info("CPU steps compiled (torch.compile, for %d threads%s) in %.1fs; --enforce-eager runs them "
                    "eagerly", threads, "" if self.compiled_prompts else "; decode only", seconds)

    def _scratch_meta(self, n: int, length: int, query_len: int = 1):
        """Metadata of ``n`` rows at ``length`` positions, each feeding its last ``query_len`` (1: a decode step;
        ``length``: whole prompts), over the cache's first blocks (before any request holds them)."""
        bs = self.block_size
        table = torch.arange(-(-length // bs), dtype=torch.int32).repeat(n, 1)
        slots = torch.arange(length - query_len, length, dtype=torch.int64).repeat(n)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=table, seq_lens=torch.full((n,), length, dtype=torch.int32),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32) * query_len,
            num_decodes=n if query_len == 1 else 0, max_query_len=query_len, max_seq_len=length,
            query_lens_cpu=[query_len] * n, seq_lens_cpu=[length] * n)
        return self._group_metas(meta, [t for _ in self.group_tables for t in (slots, table)])

    def _static_meta(self, b: int):
        s = self._static
        meta = AttentionMetadata(
            slot_mapping=s["slots"][:b], block_tables=s["table"][:b], seq_lens=s["seq_lens"][:b],
            query_start_loc=s["qsl"][: b + 1], num_decodes=b, max_query_len=1,
            max_seq_len=self._max_model_len, query_lens_cpu=[1] * b, seq_lens_cpu=[self._max_model_len] * b,
        )
        return self._group_metas(meta, [t[:b] for g in range(1, len(self.group_tables) + 1)
                                        for t in (s[f"slots{g}"], s[f"table{g}"])])

    def _replay(self, seqs: list[ScheduledSeq]):
        ids, pos, slots, seq_lens, table, rows, groups, lora_slots = self._decode_rows(seqs)
        n = len(ids)
        b = next(size for size in sorted(self.graphs) if size >= n)
        s = self._static
        groups = [(_padded(a, b, -1), t) if t is np.int64 else (a, t) for a, t in groups]  # padded slots
        lora = None
        if lora_slots is not None:  # padding rows read no adapter
            lora = host_segments(_padded(lora_slots, b, -1), self.lora.max_loras)
        ids_t, pos_t, slots_t, lens_t, table_t, rows_t, dst, src, *staged = self._stage(
            (_padded(ids, b, 0), np.int64), (_padded(pos, b, 0), np.int64), (_padded(slots, b, -1), np.int64),
            (_padded(seq_lens, b, 0), np.int32), (table, np.int32), (rows, np.int64), *self._placeholders(seqs),
            *groups, *([(a, np.int32) for a in lora[0]] if lora is not None else []))
        staged, lora_t = staged[: len(groups)], staged[len(groups):]
        self._fill_placeholders(ids_t, dst, src)
        if lora is not None:
            static = self.lora.static
            for dst_t, src_t in zip((static.sorted_tokens[:b], static.seg_start, static.seg_slot), lora_t):
                dst_t.copy_(src_t)
            self.lora.wait_for({slot for slot, _, _ in lora[1]})
        s["ids"][:b].copy_(ids_t)
        s["pos"][:b].copy_(pos_t)
        s["slots"][:b].copy_(slots_t)
        s["seq_lens"][:b].copy_(lens_t)
        s["table"][:n, :table_t.shape[1]].copy_(table_t)
        for g in range(1, len(self.group_tables) + 1):
            g_slots, g_table = staged[2 * g - 2], staged[2 * g - 1]
            s[f"slots{g}"][:b].copy_(g_slots)
            s[f"table{g}"][:n, :g_table.shape[1]].copy_(g_table)
        self.graphs[b].replay()
        logits = self._logits[b][:n] if len(rows) == n else self._logits[b][rows_t]
        return logits, [sc for sc in seqs if sc.samples]


class LaunchedStep:
    """A launched step: ``fetch()`` waits for its tokens and returns them as a ``RunnerOutput`` (the same
    one each time: structured outputs take a step's tokens before the engine applies them)."""

    def __init__(self, sample: SampleResult | None, prompt: PromptScores | None = None,
                 pooled: PooledStates | None = None) -> None:
        self.sample = sample
        self.prompt = prompt
        self.pooled = pooled
        self._output: RunnerOutput | None = None

    def fetch(self) -> RunnerOutput:
        if self._output is None:
            prompt = self.prompt.fetch() if self.prompt is not None else {}
            pooled = self.pooled.fetch() if self.pooled is not None else {}
            if self.sample is None:
                self._output = RunnerOutput(prompt_logprobs=prompt, pooled=pooled)
            else:
                sampled, logprobs = self.sample.fetch()
                self._output = RunnerOutput(sampled, logprobs, prompt, pooled)
        return self._output
