"""Speculative decoding on the engine side: before each step, ask the proposer for draft tokens for the
decoding requests, within each request's room and the adaptive no-regression policy. The drafts ride
the next plan as tokens to verify (kvloom.core.worker.rejection_sampler decides what stays)."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.core.request import Request

MAX_BACKOFF_DOUBLINGS = 6  # a request that keeps missing probes every 64 * retry_after_steps at most


@dataclass(frozen=True)
class SpeculationPolicy:
    """When not to propose, so speculation never makes a workload much slower.

    * A request whose recent acceptance (a moving average of accepted / proposed drafts, the newest
      step weighing a quarter, from 0.5 for a new request; a step where the proposer found nothing counts
      as none accepted) falls
      below ``min_acceptance`` stops proposing. It probes again on the next step that is a multiple of
      ``retry_after_steps``, doubling that period after each probe that misses (up to 64x). Probes of
      all requests fall on the same steps, so every other step runs as a plain decode (CUDA graphs,
      async scheduling).
    * A step with more than ``max_batch_size`` running requests proposes nothing: such a step is
      compute-bound, so verifying drafts costs nearly as much as it saves (0: never skip for size).
    """

    min_acceptance: float = 0.2
    retry_after_steps: int = 16
    max_batch_size: int = 32
    adaptive: bool = True


class Speculator:
    def __init__(self, proposer, max_model_len: int, policy: SpeculationPolicy | None = None, kv=None) -> None:
        self.proposer = proposer
        self.kv = kv  # the KV-cache manager, for proposers that write KV at the drafts' positions
        self.k = proposer.num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = policy or getattr(proposer, "policy", None) or SpeculationPolicy()
        self.step = 0  # steps seen, the clock of the probes

    def active(self, num_running: int) -> bool:
        """Whether this step may propose at all (else it runs like a step without speculation)."""
        p = self.policy
        return not (p.adaptive and p.max_batch_size and num_running > p.max_batch_size)

    def wants_host_tokens(self, running: list[Request]) -> bool:
        """Whether the coming step would propose for any of these requests: a proposer reads the newest
        tokens, so that step waits for the one in flight instead of overlapping it."""
        return self.active(len(running)) and any(
            r.num_computed_tokens >= r.num_prompt_tokens and not r.awaiting_final_token and self._wants(r, self.step + 1)
            for r in running)

    def propose(self, running: list[Request], decoding: list[Request]) -> int:
        """Set ``spec_token_ids`` on the decoding requests that get drafts (every other running request's
        are cleared: a draft is only valid right after the tokens it was proposed for); returns how
        many drafts were set."""
        self.step += 1
        for r in running:
            r.spec_token_ids = []
        if not decoding or not self.active(len(running)):
            return 0
        wanted = [r for r in decoding if self._wants(r, self.step)]
        if not wanted:
            return 0
        p = self.policy
        for r in wanted:
            if p.adaptive and r.recent_acceptance < p.min_acceptance:  # a probe: one more chance
                r.spec_failed_probes += 1  # until its drafts are accepted (the scheduler resets it)
                r.recent_acceptance = p.min_acceptance
        if getattr(self.proposer, "reserves_kv_slots", False) and self.kv is not None:
            wanted = [r for r in wanted if self._reserve(r, len(running))]
            if not wanted:
                return 0
        drafts = self.proposer.propose(wanted)
        total = 0
        for r in wanted:
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            d = list(drafts.get(r.request_id, ()))[: max(0, room)]
            r.spec_token_ids = d
            total += len(d)
            if not d and room > 0:
                r.recent_acceptance *= 0.75  # nothing to propose costs a synchronised step all the same
        return total

    def _reserve(self, r: Request, num_running: int) -> bool:
        """Allocate the blocks that the next step's drafts will need (a draft model writes its KV there
        first), leaving a block per running request free: drafts never cause a preemption."""
        room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
        if room < 1:
            return False
        need = self.kv.blocks_for(r.num_tokens + room) - len(r.block_ids)
        if need > 0 and self.kv.num_free_blocks() < need + num_running:
            return False
        return self.kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens + room)

    def _wants(self, r: Request, step: int) -> bool:
        p = self.policy
        if not p.adaptive or r.recent_acceptance >= p.min_acceptance:
            return True
        period = p.retry_after_steps << min(r.spec_failed_probes, MAX_BACKOFF_DOUBLINGS)
        return step % period == 0
