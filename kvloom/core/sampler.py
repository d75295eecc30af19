"""Batched sampling with per-request parameters: greedy, temperature, top-k, top-p, min-p, seeds,
repetition/presence/frequency penalties, min_tokens, and top-n logprobs."""

from __future__ import annotations

import torch

from kvloom.core.messages import TokenLogprobs, TopLogprob
from kvloom.core.request import Request


class SampleResult:
    """Sampled tokens (and logprobs) still on the device; ``fetch`` brings them to the host.

    ``start_copy`` queues the device-to-host copies without waiting, so a caller can schedule the
    next step while the GPU finishes this one.
    """

    def __init__(self, tokens: torch.Tensor, params, logprob_parts=None) -> None:
        self.tokens = tokens  # [N] int64 on the device: also the next step's input ids
        self.params = params
        self._parts = [tokens] + list(logprob_parts or [])
        self._host: list[torch.Tensor] | None = None
        self._event = None

    def start_copy(self) -> None:
        if self.tokens.is_cuda:
            self._host = [t.to("cpu", non_blocking=True) for t in self._parts]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self._parts

    def fetch(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[0].tolist()
        if len(self._host) == 1:
            return tokens, [None] * len(tokens)
        chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
        out: list[TokenLogprobs | None] = []
        for i, p in enumerate(self.params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = [TopLogprob(top_ids[i][j], top_vals[i][j]) for j in range(p.logprobs)]
            out.append(TokenLogprobs(tokens[i], chosen[i], top))
        return tokens, out


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """One token per row of ``logits`` (``[N, V]`` float32) for the matching request; the result
        stays on the device until fetched."""
        params = [r.sampling for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), requests)
        blocked = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.sampling.min_tokens]
        if blocked:
            for i, r in blocked:
                ids = list(r.eos_token_ids) + list(r.stop_token_ids)
                if ids:
                    logits[i, ids] = float("-inf")

        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        if raw_logprobs is None:
            return SampleResult(tokens, params)
        k = max(p.logprobs or 0 for p in params)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
        return SampleResult(tokens, params, (chosen, top_vals, top_ids))

    # ---------------------------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        n, vocab = logits.shape
        rep = torch.tensor([r.sampling.repetition_penalty for r in requests], device=logits.device)
        pres = torch.tensor([r.sampling.presence_penalty for r in requests], device=logits.device)
        freq = torch.tensor([r.sampling.frequency_penalty for r in requests], device=logits.device)
        out_counts = self._counts([r.output_token_ids for r in requests], n, vocab, logits.device)
        if (rep != 1.0).any():
            # Hugging Face's rule over prompt and output tokens: shrink positive logits, grow negative ones.
            seen = self._counts([r.all_token_ids for r in requests], n, vocab, logits.device) > 0
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

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling for r in requests]
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temp[:, None]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k = torch.tensor([k if k else logits.shape[-1] for k in top_k], device=device).clamp(max=logits.shape[-1])
            kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest set whose mass reaches top_p (the token that crosses it stays).
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        # Gumbel-style sampling without a host sync: argmax(p / Exp(1)) draws from p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.sampling.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=device).manual_seed(r.sampling.seed)
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
