"""The ``draft`` proposer: a smaller model with the target's vocabulary proposes ``k`` tokens per request
by ``k`` greedy forwards, batched over the requests, over its own paged KV cache. That cache has the
same number of blocks as the target's and is indexed by the target's block tables (the same block ids),
so the scheduler's allocation, preemption and trimming cover both; the draft's blocks come out of the
same memory budget (the engine splits it by bytes per token).

The draft's KV is trusted only for a request's known tokens (prompt and accepted ones): each step first
feeds the draft the tokens it has not seen since its last proposal (the newest accepted drafts and the
target's token), which overwrites whatever rejected drafts left in those slots. That is the draft's
rollback; it follows the target's, since both count in accepted tokens."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from kvloom.core.engine import capacity
from kvloom.core.engine.request import PLACEHOLDER
from kvloom.core.engine.step import ScheduledSeq, SchedulerOutput
from kvloom.core.sampling_params import SamplingParams

logger = logging.getLogger("kvloom")
GREEDY = SamplingParams(temperature=0.0)


class DraftVocabularyError(ValueError):
    """The draft model's vocabulary is not the target's."""


class DraftModelProposer:
    name = "draft"
    reserves_kv_slots = True  # the engine allocates blocks for the drafts' positions before proposing

    def __init__(self, num_speculative_tokens: int, draft_model: str, draft_dtype: str = "auto") -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_model = draft_model
        self.draft_dtype = draft_dtype
        self.model = self.runner = None
        self.kv_bytes_per_token = 0
        # Per request id: (known tokens whose draft KV is valid, the request's preemption count then).
        self._seen: dict[str, tuple[int, int]] = {}

    # --- set-up (EngineCore calls these in order) ----------------------------------------------------
    def check_vocabulary(self, target_hf_config) -> None:
        """Raise DraftVocabularyError when the draft cannot propose the target's token ids."""
        from kvloom.core.model.files import resolve_model
        from kvloom.core.model.loader import load_hf_config

        self.path = resolve_model(self.draft_model)
        self.hf_config = load_hf_config(self.path)
        mine, theirs = self.hf_config.vocab_size, target_hf_config.vocab_size
        if mine != theirs:
            raise DraftVocabularyError(
                f"spec_decode draft_model {self.draft_model!r} has vocab_size={mine} but the target model has "
                f"vocab_size={theirs}: the draft model must share the target's tokenizer and vocabulary")

    def load(self, *, device: torch.device, dtype: torch.dtype, load_format: str, max_model_len: int,
             seed: int, max_num_batched_tokens: int | None = None, kernels=None) -> None:
        from kvloom.core.engine.core import resolve_dtype
        from kvloom.core.model.attention.selector import get_attention_backend
        from kvloom.core.model.loader import build_model

        self.dtype = dtype if self.draft_dtype == "auto" else resolve_dtype(self.draft_dtype, device)
        self.device = device
        from kvloom.kernels.options import DEFAULT_KERNELS

        kernels = kernels or DEFAULT_KERNELS
        self.backend = get_attention_backend(device, kernels)  # its own (backends keep per-shape workspaces)
        self.model = build_model(self.path, self.hf_config, load_format="dummy" if load_format == "dummy" else "auto",
                                 device=device, dtype=self.dtype, backend=self.backend, max_positions=max_model_len,
                                 seed=seed + 1, kernels=kernels)
        self.max_model_len = max_model_len
        # The draft's forwards stay within the target's step budget (what the memory profile measured).
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.kv_bytes_per_token = capacity.kv_bytes_per_token(self.hf_config, self.dtype)

    def allocate_kv(self, num_blocks: int, block_size: int, seed: int) -> None:
        from kvloom.core.worker.model_runner import ModelRunner

        layers, kv_heads, head_dim = capacity.model_dims(self.hf_config)
        shape = self.backend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(layers)]
        self.block_size = block_size
        self.runner = ModelRunner(self.model, caches, block_size, self.device, seed)
        logger.info("Draft model %s (%s): KV cache of %d blocks beside the target's, %d bytes/token",
                    self.draft_model, str(self.dtype).removeprefix("torch."), num_blocks, self.kv_bytes_per_token)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.runner.capture_graphs(max_num_seqs, max_model_len)

    # --- proposing ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence) -> dict[str, list[int]]:
        """k greedy draft forwards: the first over each request's unseen known tokens (a varlen batch;
        after long prompts, chunks within max_num_batched_tokens go first), the others one token per
        request, fed from the previous forward's tokens on the device. One host sync at the end."""
        if len(self._seen) > 4 * len(requests) + 256:  # finished requests' entries
            live = {r.request_id for r in requests}
            self._seen = {rid: v for rid, v in self._seen.items() if rid in live}
        first, rooms = [], {}
        for r in requests:
            n = r.num_tokens
            room = min(self.num_speculative_tokens, len(r.block_ids) * self.block_size - n + 1,
                       r.max_tokens - r.num_output_tokens - 1, self.max_model_len - n - 1)
            if room < 1:
                continue
            seen, preemptions = self._seen.get(r.request_id, (0, -1))
            if preemptions != r.num_preemptions:
                seen = 0  # its blocks were freed: the draft starts over
            seen = min(seen, n - 1)
            rooms[r.request_id] = room
            first.append(ScheduledSeq(r.request_id, r.all_token_ids[seen:n], seen, list(r.block_ids), 1, GREEDY))
            self._seen[r.request_id] = (n, r.num_preemptions)
        if not first:
            return {}
        if sum(s.num_new_tokens for s in first) > self.max_num_batched_tokens:
            first = self._prefill_in_chunks(first)
        steps = [first]
        for j in range(2, self.num_speculative_tokens + 1):
            seqs = [ScheduledSeq(s.request_id, [PLACEHOLDER], s.start_pos + s.num_new_tokens + j - 2, s.block_ids, 1,
                                 GREEDY, num_placeholders=1) for s in first if rooms[s.request_id] >= j]
            if not seqs:
                break
            steps.append(seqs)
        parts, where = [], []
        offset = 0
        for j, seqs in enumerate(steps):
            launched = self.runner.execute(SchedulerOutput(j, seqs))
            parts.append(launched.sample.tokens)
            where.append({rid: offset + row for rid, row in self.runner._prev_rows.items()})
            offset += launched.sample.tokens.shape[0]
        tokens = torch.cat(parts).tolist()
        return {s.request_id: [tokens[w[s.request_id]] for w in where if s.request_id in w] for s in first}

    def _prefill_in_chunks(self, first: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Feed every unseen token but each request's last in forwards of at most max_num_batched_tokens
        (chunked prefill, as the target's: a long prompt is never one giant forward), sampling nothing;
        returns the first proposing forward, one token per request."""
        budget = self.max_num_batched_tokens
        chunk: list[ScheduledSeq] = []
        used = 0
        for s in first:
            ids, pos = s.token_ids[:-1], s.start_pos
            while ids:
                take = min(len(ids), budget - used)
                chunk.append(ScheduledSeq(s.request_id, ids[:take], pos, s.block_ids, 0, GREEDY))
                ids, pos, used = ids[take:], pos + take, used + take
                if used == budget:
                    self.runner.execute(SchedulerOutput(0, chunk))
                    chunk, used = [], 0
        if chunk:
            self.runner.execute(SchedulerOutput(0, chunk))
        return [ScheduledSeq(s.request_id, s.token_ids[-1:], s.start_pos + s.num_new_tokens - 1, s.block_ids, 1,
                             GREEDY) for s in first]
