"""Batched sampling with per-request parameters: greedy, temperature, top-k, top-p, min-p, seeds,
repetition/presence/frequency penalties, min_tokens, top-n logprobs, and the verification of draft
tokens (kvloom.core.worker.rejection_sampler). It reads only the step's plan values
(``ScheduledSeq``), never a live request."""

from __future__ import annotations

from typing import Sequence

import torch

from kvloom.core.engine.step import LogprobLists, PromptLogprobs, ScheduledSeq
from kvloom.core.sampling_params import SamplingParams
from kvloom.core.worker import rejection_sampler
from kvloom.kernels import ops


class SampleResult:
    """One step's sampled rows still on the device; ``fetch`` brings them to the host.

    ``tokens[r]`` is row ``r``'s token from the target (the next token, or the replacement for a
    rejected draft); ``accepted[r]`` says whether the draft verified at row ``r`` was kept. ``start_copy``
    queues the device-to-host copies without waiting, so the next step can be scheduled meanwhile.
    """

    def __init__(self, tokens: torch.Tensor, seqs: Sequence[ScheduledSeq], accepted: torch.Tensor | None = None,
                 logprob_parts=None) -> None:
        self.tokens = tokens  # [R] int64 on the device: also the next step's input ids
        self.seqs = seqs
        self._parts = [tokens] + ([accepted] if accepted is not None else []) + list(logprob_parts or [])
        self._has_accepted = accepted is not None
        self._host: list[torch.Tensor] | None = None
        self._event = None

    def start_copy(self) -> None:
        if self.tokens.is_cuda:
            self._host = [t.to("cpu", non_blocking=True) for t in self._parts]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self._parts

    def fetch(self) -> tuple[dict[str, list[int]], dict[str, LogprobLists]]:
        """Per request id: its accepted drafts then the target's token; and logprobs where asked for."""
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        host = iter(self._host)
        tokens = next(host).tolist()
        accepted = next(host).tolist() if self._has_accepted else None
        sampled: dict[str, list[int]] = {}
        row = 0
        for s in self.seqs:
            n = len(s.draft_token_ids)
            a = 0
            while a < n and accepted[row + a]:
                a += 1
            sampled[s.request_id] = s.draft_token_ids[:a] + [tokens[row + a]]
            row += s.num_sample_rows
        logprobs: dict[str, LogprobLists] = {}
        parts = list(host)
        if parts:
            chosen, top_vals, top_ids = (t.tolist() for t in parts)
            row = 0
            for s in self.seqs:
                k, m = s.sampling.logprobs, len(sampled[s.request_id])
                if k is not None:
                    logprobs[s.request_id] = LogprobLists(
                        chosen[row: row + m], [ids[:k] for ids in top_ids[row: row + m]],
                        [vals[:k] for vals in top_vals[row: row + m]])
                row += s.num_sample_rows
        return sampled, logprobs


# Full-vocabulary logits of prompt positions are made this many rows at a time, so a long prompt's
# logprobs never hold [prompt, vocab] floats at once (4096 x 49152 floats is 800 MB).
PROMPT_LOGITS_ROWS = 256


def prompt_logits_slices(num_rows: int) -> list[slice]:
    """The slices of scored rows whose logits are made one at a time (a TP worker's all-gathers pair with
    rank 0's through these)."""
    return [slice(i, min(i + PROMPT_LOGITS_ROWS, num_rows)) for i in range(0, num_rows, PROMPT_LOGITS_ROWS)]


class PromptScores:
    """Logprobs of the prompt tokens a step scored (``ScheduledSeq.prompt_targets``), still on the
    device; ``fetch`` brings them to the host per request."""

    def __init__(self, seqs: Sequence[ScheduledSeq], parts: list[torch.Tensor]) -> None:
        self.seqs = seqs
        self._parts = parts  # chosen logprob, rank, top values, top ids: one row per scored position
        self._event = None

    def start_copy(self) -> None:
        if self._parts[0].is_cuda:
            self._parts = [t.to("cpu", non_blocking=True) for t in self._parts]
            self._event = torch.cuda.Event()
            self._event.record()

    def fetch(self) -> dict[str, PromptLogprobs]:
        if self._event is not None:
            self._event.synchronize()
        chosen, ranks, top_vals, top_ids = (t.tolist() for t in self._parts)
        out, row = {}, 0
        for s in self.seqs:
            n, k = len(s.prompt_targets), s.sampling.prompt_logprobs
            out[s.request_id] = PromptLogprobs(
                s.start_pos + 1, list(s.prompt_targets), chosen[row: row + n], ranks[row: row + n],
                [ids[:k] for ids in top_ids[row: row + n]], [vals[:k] for vals in top_vals[row: row + n]])
            row += n
        return out


def score_prompt(hidden: torch.Tensor, seqs: Sequence[ScheduledSeq], compute_logits) -> PromptScores:
    """Logprobs of each ``prompt_targets`` token under the logits of the position before it: ``hidden``
    holds those positions' final states, in the order of ``seqs``. Raw logprobs (no temperature or
    penalties), as vLLM's prompt_logprobs and OpenAI's echo report them."""
    targets = torch.tensor([t for s in seqs for t in s.prompt_targets], dtype=torch.int64).to(hidden.device)
    k = max(s.sampling.prompt_logprobs for s in seqs)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for rows in prompt_logits_slices(len(targets)):
        logprobs = torch.log_softmax(compute_logits(hidden[rows]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[rows, None])
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        for part, t in zip(parts, (chosen[:, 0], (logprobs > chosen).sum(-1) + 1, top_vals, top_ids)):
            part.append(t)
    return PromptScores(seqs, [torch.cat(p) for p in parts])


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}  # seeded requests, by request id

    def remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> SampleResult:
        """Tokens for the rows of ``logits`` (``[R, V]`` float32): ``num_sample_rows`` consecutive rows per
        sequence, in order. A sequence with drafts gets them verified; the result stays on the device."""
        params = [s.sampling for s in seqs]
        row_params = [s.sampling for s in seqs for _ in range(s.num_sample_rows)]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), seqs, row_params)
        if any(p.logit_bias for p in params):
            logits = _apply_logit_bias(logits, seqs)
        self._block_stop_tokens(logits, seqs)
        if any(s.token_bitmask is not None for s in seqs):
            _apply_token_bitmasks(logits, seqs)

        drafts = [t for s in seqs if s.draft_token_ids for t in s.draft_token_ids + [-1]]
        if not drafts:
            if all(p.greedy for p in params):
                tokens = ops.greedy_argmax(logits)
            else:
                probs = target_probs(logits, row_params)
                noise = self._noise(seqs, probs.shape[1], logits.device)
                tokens = rejection_sampler.greedy_or_sample(logits, probs, noise, row_params)
            accepted, chosen_tokens = None, tokens
        else:
            draft_rows = rejection_sampler.host_to_device(
                [t for s in seqs for t in (s.draft_token_ids + [-1] if s.draft_token_ids else [-1])],
                torch.int64, logits.device)
            probs = None if all(p.greedy for p in params) else target_probs(logits, row_params)
            noise = uniform = None
            if probs is not None:
                noise = self._noise(seqs, probs.shape[1], logits.device)
                uniform = self._uniform(seqs, logits.device)
            tokens, accepted = rejection_sampler.verify(logits, probs, draft_rows, noise, uniform, row_params)
            chosen_tokens = torch.where(accepted, draft_rows, tokens)
        if raw_logprobs is None:
            return SampleResult(tokens, seqs, accepted)
        k = max(p.logprobs or 0 for p in params)
        chosen = raw_logprobs.gather(1, chosen_tokens[:, None])[:, 0]
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
        return SampleResult(tokens, seqs, accepted, (chosen, top_vals, top_ids))

    # ---------------------------------------------------------------------------------------------
    def _generator(self, s: ScheduledSeq) -> torch.Generator | None:
        if s.sampling.seed is None:
            return None
        gen = self.request_generators.get(s.request_id)
        if gen is None:
            gen = self.request_generators[s.request_id] = torch.Generator(device=self.device).manual_seed(s.sampling.seed)
        return gen

    def _noise(self, seqs: Sequence[ScheduledSeq], vocab: int, device) -> torch.Tensor:
        """Exponential(1) noise per row: from the request's own generator when it has a seed (so its
        tokens do not depend on the batch it shares), else from the engine's."""
        rows = sum(s.num_sample_rows for s in seqs)
        noise = torch.empty(rows, vocab, device=device)
        unseeded, row = [], 0
        for s in seqs:
            gen = self._generator(s)
            if gen is None:
                unseeded.extend(range(row, row + s.num_sample_rows))
            else:
                for r in range(row, row + s.num_sample_rows):
                    noise[r].exponential_(generator=gen)
            row += s.num_sample_rows
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self.generator)
        return noise

    def _uniform(self, seqs: Sequence[ScheduledSeq], device) -> torch.Tensor:
        parts = []
        for s in seqs:
            gen = self._generator(s) or self.generator
            parts.append(torch.rand(s.num_sample_rows, device=device, generator=gen))
        return torch.cat(parts)

    @staticmethod
    def _block_stop_tokens(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
        """Under min_tokens, EOS and stop ids cannot be sampled (row ``j`` of a sequence is its output
        token ``num_output_tokens + j``)."""
        row = 0
        for s in seqs:
            if s.stop_token_ids:
                blocked = max(0, min(s.num_sample_rows, s.sampling.min_tokens - s.num_output_tokens))
                if blocked:
                    ids = torch.tensor(s.stop_token_ids, device=logits.device)
                    logits[row: row + blocked, ids] = float("-inf")
            row += s.num_sample_rows

    def _apply_penalties(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
                         row_params: list[SamplingParams]) -> torch.Tensor:
        n, vocab = logits.shape
        device = logits.device
        rep = torch.tensor([p.repetition_penalty for p in row_params], device=device)
        pres = torch.tensor([p.presence_penalty for p in row_params], device=device)
        freq = torch.tensor([p.frequency_penalty for p in row_params], device=device)
        # Row j of a sequence sees its history plus the drafts before it (accepted if row j counts).
        everything, outputs = [], []
        for s in seqs:
            history = list(s.history or ())
            for j in range(s.num_sample_rows):
                seen = history + s.draft_token_ids[:j]
                everything.append(seen)
                outputs.append(seen[s.num_prompt_tokens:] if s.history is not None else [])
        out_counts = self._counts(outputs, n, vocab, device)
        if (rep != 1.0).any():
            # Hugging Face's rule over prompt and output tokens: shrink positive logits, grow negative ones.
            seen = self._counts(everything, n, vocab, device) > 0
            penalized = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
            logits = torch.where(seen, penalized, logits)
        # OpenAI's rule over generated tokens only.
        logits -= freq[:, None] * out_counts + pres[:, None] * (out_counts > 0).float()
        return logits

    @staticmethod
    def _counts(seqs: list[list[int]], n: int, vocab: int, device) -> torch.Tensor:
        counts = torch.zeros(n, vocab, device=device)
        longest = max((len(s) for s in seqs), default=0)
        if longest == 0:
            return counts
        ids = torch.full((n, longest), vocab, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(device)
        padded = torch.zeros(n, vocab + 1, device=device)
        padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=padded.dtype))
        return padded[:, :vocab]


def _apply_logit_bias(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit shifted by its bias, in every row of the request."""
    rows, ids, biases = [], [], []
    row = 0
    for s in seqs:
        for token, bias in s.sampling.logit_bias.items():
            for r in range(row, row + s.num_sample_rows):
                rows.append(r)
                ids.append(token)
                biases.append(bias)
        row += s.num_sample_rows
    logits = logits.clone()  # the runner's logits may be a CUDA graph's output buffer
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                      torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)
    return logits


def _apply_token_bitmasks(logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> None:
    """Structured outputs: tokens outside each constrained row's grammar mask get -inf, in one batched
    call of xgrammar's kernel on the logits' device (a CPU loop in C++, a GPU kernel on CUDA). The masks
    are packed int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``."""
    import xgrammar

    rows, masks = [], []
    row = 0
    for s in seqs:
        if s.token_bitmask is not None:
            rows.extend(range(row, row + s.num_sample_rows))
            masks.append(s.token_bitmask)
        row += s.num_sample_rows
    # -1: every token allowed. Pinned on CUDA (the caching host allocator keeps it until its copy is
    # done), so the copy is one DMA on the stream rather than a staged copy through the driver. Every row
    # is in it, so the kernel needs no row indices (a list it would copy to the device on every call).
    full = torch.full((row, masks[0].shape[1]), -1, dtype=torch.int32, pin_memory=logits.is_cuda)
    full[rows] = torch.cat(masks)
    xgrammar.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                         vocab_size=logits.shape[1])


def target_probs(logits: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p and min-p (greedy rows get
    temperature 1; their probabilities are not used)."""
    device = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in row_params], device=device)
    logits = logits / temp[:, None]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in row_params]
    if any(top_k):
        k = torch.tensor([k if k else logits.shape[-1] for k in top_k], device=device).clamp(max=logits.shape[-1])
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in row_params):
        top_p = torch.tensor([p.top_p for p in row_params], device=device)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token that crosses it stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0.0 for p in row_params):
        min_p = torch.tensor([p.min_p for p in row_params], device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs
