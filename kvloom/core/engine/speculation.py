"""Speculative decoding on the engine side: before each step, ask the proposer for draft tokens for the
decoding requests, within each request's room and the adaptive no-regression policy. The drafts ride
the next plan as tokens to verify (kvloom.core.worker.rejection_sampler decides what stays)."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.core.request import Request


@dataclass(frozen=True)
class SpeculationPolicy:
    """When not to propose, so speculation never makes a workload much slower.

    * A request whose recent acceptance (a moving average of accepted / proposed drafts, halving the
      weight of older steps) falls below ``min_acceptance`` stops proposing for ``retry_after_steps``
      steps, then tries again.
    * A step with more than ``max_batch_size`` running requests proposes nothing: such a step is
      compute-bound, so verifying drafts costs nearly as much as it saves (0: never skip for size).
    """

    min_acceptance: float = 0.2
    retry_after_steps: int = 16
    max_batch_size: int = 32
    adaptive: bool = True


class Speculator:
    def __init__(self, proposer, max_model_len: int, policy: SpeculationPolicy | None = None) -> None:
        self.proposer = proposer
        self.k = proposer.num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = policy or getattr(proposer, "policy", None) or SpeculationPolicy()

    def active(self, num_running: int) -> bool:
        """Whether this step may propose at all (else it runs like a step without speculation)."""
        p = self.policy
        return not (p.adaptive and p.max_batch_size and num_running > p.max_batch_size)

    def propose(self, running: list[Request], decoding: list[Request]) -> int:
        """Set ``spec_token_ids`` on the decoding requests that get drafts (every other running request's
        are cleared: a draft is only valid right after the tokens it was proposed for); returns how
        many drafts were set."""
        for r in running:
            r.spec_token_ids = []
        if not decoding or not self.active(len(running)):
            return 0
        wanted = [r for r in decoding if self._wants(r)]
        if not wanted:
            return 0
        drafts = self.proposer.propose(wanted)
        total = 0
        for r in wanted:
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            d = list(drafts.get(r.request_id, ()))[: max(0, room)]
            r.spec_token_ids = d
            total += len(d)
        return total

    def _wants(self, r: Request) -> bool:
        p = self.policy
        if not p.adaptive or r.recent_acceptance >= p.min_acceptance:
            return True
        r.spec_cooldown += 1
        if r.spec_cooldown >= p.retry_after_steps:
            r.spec_cooldown = 0
            r.recent_acceptance = p.min_acceptance  # one more chance; a miss sends it back to waiting
            return True
        return False
