"""Speculative decoding on the engine side: before each step, ask the proposer for draft tokens for the
decoding requests, within each request's room and the adaptive no-regression policy (a cost model of
the step, fitted online: ``StepCostModel``). The drafts ride the next plan as tokens to verify
(kvloom.core.worker.rejection_sampler decides what stays)."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.core.engine.request import Request

MAX_BACKOFF_DOUBLINGS = 6  # a request that keeps missing probes every 64 * retry_after_steps at most


@dataclass(frozen=True)
class SpeculationPolicy:
    """When not to propose, so speculation never makes a workload much slower.

    * **Goodput** (``goodput``): a step proposes only as many drafts as raise its expected useful
      tokens per second. Useful tokens are the plain step's (every prefill and decode token it computes)
      plus each draft's chance of acceptance; the step's time comes from ``StepCostModel``, a line
      ``t = a + b * x`` fitted to the engine's recent steps (``x``: tokens, with each sampled row weighted
      by the extra work of its logits). Draft ``j`` of a request whose per-token acceptance is ``alpha``
      is worth ``alpha ** j``; drafts are taken from the most valuable down while their worth beats
      ``b * (1 + w)`` (the cost of a verify row) times the step's tokens per second so far. So where the
      step is compute-bound (a CPU under load: ``a`` small beside ``b * x``) a draft must be nearly sure,
      where it is memory-bound (a GPU decode: ``b`` tiny) nearly any draft pays, and a request may get
      fewer than ``num_speculative_tokens`` drafts. Until the model has seen steps of different sizes
      it allows every draft (the old rule), which is also how it learns.
    * **Prefill first**: drafts only take the step budget (``max_num_batched_tokens``) that the known
      tokens of running requests and the prefill of waiting requests leave; a step whose budget is
      contested proposes nothing (the scheduler enforces the order too).
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
    goodput: bool = True


class StepCostModel:
    """Seconds per step against the step's size, ``t = a + b * x``, by least squares over recent steps
    (each older step's weight decays by ``decay``). ``x`` counts a step's tokens plus
    ``logits_weight`` per sampled row: a row that samples also runs the LM head, which a prefill row
    does not (``logits_weight`` is the LM head's share of a token's work, ``logits_row_weight``).

    The slope it reports is the fit's less two standard errors (clamped at 0): step times on a shared
    machine are noisy, and a slope that the noise could explain must not switch speculation off, so
    drafts stop only where the steps show clearly that a token costs time."""

    MIN_STEPS = 8  # steps seen before the fit is trusted
    MIN_SPREAD = 1.0  # weighted standard deviation of x (tokens) below which the slope is unknown

    def __init__(self, logits_weight: float = 0.0, decay: float = 0.95) -> None:
        self.logits_weight = logits_weight
        self.decay = decay
        self.num_steps = 0
        self._w = self._ww = self._x = self._y = self._xx = self._xy = self._yy = 0.0

    def size(self, tokens: int, rows: int) -> float:
        return tokens + self.logits_weight * rows

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        self.num_steps += 1
        if self.num_steps == 1 or tokens <= 0 or seconds <= 0.0:
            return  # an engine's first step also pays for warming up
        x, d = self.size(tokens, rows), self.decay
        self._w = d * self._w + 1.0
        self._ww = d * d * self._ww + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds
        self._yy = d * self._yy + seconds * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, or None while the steps seen cannot tell the slope (too few, or all one size)."""
        if self.num_steps <= self.MIN_STEPS:
            return None
        w = self._w
        mx, my = self._x / w, self._y / w
        sxx, sxy, syy = self._xx - w * mx * mx, self._xy - w * mx * my, self._yy - w * my * my
        if sxx < w * self.MIN_SPREAD ** 2:
            return None
        b = sxy / sxx
        n_eff = w * w / self._ww  # the number of equally weighted steps with the same information
        residual = max(0.0, syy - b * sxy) / w  # the weighted mean squared residual
        se = (residual * n_eff / max(n_eff - 2.0, 1.0) / sxx * w / n_eff) ** 0.5
        b = max(0.0, b - 2.0 * se)
        return max(0.0, my - b * mx), b


def logits_row_weight(hf_config) -> float:
    """The LM head's work for one row against the layers' (matrix multiplies only): what a sampled row
    costs beyond a prefill row, as a share of a token. 0 where the config does not tell."""
    try:
        h, layers, vocab = hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.vocab_size
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or h // heads
        kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
        inter = hf_config.intermediate_size
    except (AttributeError, TypeError):
        return 0.0
    per_layer = 2 * h * heads * head_dim + 2 * h * kv + 3 * h * inter
    return vocab * h / (layers * per_layer) if per_layer and layers else 0.0


def per_token_acceptance(rate: float, k: int) -> float:
    """The per-token acceptance ``alpha`` for which ``k`` drafts see ``rate`` of them accepted on
    average, each draft accepted with ``alpha`` after its predecessor was: ``rate = (alpha + ... +
    alpha ** k) / k`` (bisection; the left side grows with alpha)."""
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0 or k <= 1:
        return min(1.0, rate)
    lo, hi = 0.0, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        term, total = 1.0, 0.0
        for _ in range(k):
            term *= mid
            total += term
        lo, hi = (mid, hi) if total / k < rate else (lo, mid)
    return (lo + hi) / 2


class Speculator:
    def __init__(self, proposer, max_model_len: int, policy: SpeculationPolicy | None = None, kv=None,
                 logits_weight: float = 0.0) -> None:
        self.proposer = proposer
        self.kv = kv  # the KV-cache manager, for proposers that write KV at the drafts' positions
        self.k = proposer.num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = policy or getattr(proposer, "policy", None) or SpeculationPolicy()
        self.cost = StepCostModel(logits_weight)
        self.step = 0  # steps seen, the clock of the probes

    def observe(self, num_tokens: int, num_rows: int, seconds: float) -> None:
        """A step's size and how long it took (the engine's timing), for the cost model."""
        self.cost.observe(num_tokens, num_rows, seconds)

    def active(self, num_running: int) -> bool:
        """Whether this step may propose at all (else it runs like a step without speculation)."""
        p = self.policy
        return not (p.adaptive and p.max_batch_size and num_running > p.max_batch_size)

    def wants_host_tokens(self, scheduler) -> bool:
        """Whether the coming step would propose for any running request: a proposer reads the newest
        tokens, so that step waits for the one in flight instead of overlapping it."""
        running = scheduler.running
        if not self.active(len(running)):
            return False
        wanted = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens
                  and not r.awaiting_final_token and self._wants(r, self.step + 1)]
        return bool(wanted) and self._worth(scheduler, wanted, len(wanted)) is not None

    def propose(self, scheduler) -> int:
        """Set ``spec_token_ids`` on the decoding requests that get drafts (every other running request's
        are cleared: a draft is only valid right after the tokens it was proposed for); returns how
        many drafts were set."""
        self.step += 1
        running = scheduler.running
        for r in running:
            r.spec_token_ids = []
        decoding = scheduler.decoding()
        if not decoding or not self.active(len(running)):
            return 0
        wanted = [r for r in decoding if self._wants(r, self.step)]
        if not wanted:
            return 0
        plan = self._worth(scheduler, wanted, len(decoding))
        if plan is None:
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
        rooms = {}
        for r in wanted:
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            rooms[r.request_id] = d = list(drafts.get(r.request_id, ()))[: max(0, room)]
            if not d and room > 0:
                r.recent_acceptance *= 0.75  # nothing to propose costs a synchronised step all the same
        counts = plan(wanted, {rid: len(d) for rid, d in rooms.items()})
        total = 0
        for r in wanted:
            r.spec_token_ids = rooms[r.request_id][: counts.get(r.request_id, 0)]
            total += len(r.spec_token_ids)
        return total

    def _worth(self, scheduler, wanted: list[Request], num_decoding: int):
        """None if no draft can pay in the coming step (no budget left after the known tokens and
        waiting prefill, or the cost model says even the likeliest draft loses); else a function of
        (requests, drafts available per request id) that says how many of each request's drafts to keep."""
        p = self.policy
        plain = scheduler.plain_step_tokens()
        left = scheduler.max_num_batched_tokens - plain
        if left <= 0:
            return None
        fit = self.cost.fit() if p.adaptive and p.goodput else None
        a, b = fit if fit is not None else (1.0, 0.0)  # no model (yet, or off): drafts are free
        t0 = a + b * self.cost.size(plain, num_decoding)
        row = b * self.cost.size(1, 1)  # one more verify row
        # A probe (acceptance under min_acceptance) is valued at min_acceptance: what it is given to prove.
        floor = p.min_acceptance if p.adaptive else 0.0
        alphas = {r.request_id: per_token_acceptance(max(r.recent_acceptance, floor), self.k) if row else 1.0
                  for r in wanted}
        if max(alphas.values()) * t0 <= row * plain:
            return None

        def keep(reqs, available):
            # Draft j of a request is worth alpha ** j tokens; take them from the most valuable down
            # while each beats a verify row's cost at the step's tokens per second so far.
            worth = sorted(((alphas[r.request_id] ** j, r.request_id) for r in reqs
                            for j in range(1, available[r.request_id] + 1)), reverse=True)
            counts: dict[str, int] = {}
            tokens, seconds = float(plain), t0
            for value, rid in worth[:left]:
                if value * seconds <= row * tokens:
                    break
                counts[rid] = counts.get(rid, 0) + 1
                tokens += value
                seconds += row
            return counts
        return keep

    def _reserve(self, r: Request, num_running: int) -> bool:
        """Allocate the blocks that the next step's drafts will need (a draft model writes its KV there
        first), leaving a block per running request free: drafts never cause a preemption."""
        room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
        if room < 1:
            return False
        need = (self.kv.blocks_for(r.num_tokens + room) - len(r.block_ids)) * len(self.kv.windows)  # every group's
        if need > 0 and self.kv.num_free_blocks() < need + num_running:
            return False
        return self.kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens + room)

    def _wants(self, r: Request, step: int) -> bool:
        p = self.policy
        if not p.adaptive or r.recent_acceptance >= p.min_acceptance:
            return True
        period = p.retry_after_steps << min(r.spec_failed_probes, MAX_BACKOFF_DOUBLINGS)
        return step % period == 0
