"""Continuous batching by token counts: each step gives running requests, then waiting ones, as many
tokens as the budget allows. Draft tokens of speculative decoding are just more tokens to compute,
given what the budget has left after every known token (prefill first); the ones the target rejects
roll ``num_computed_tokens`` back. Pure bookkeeping: no tensors here.

``schedule()`` returns a plain ``SchedulerOutput`` and ``update(plan, runner_output)`` applies a plain
``RunnerOutput``: the live ``Request`` objects never leave the scheduler."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kvloom.core.engine.adapters import AdapterSlots
from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.request import PLACEHOLDER, Request, RequestStatus
from kvloom.core.engine.step import LoRALoad, RunnerOutput, ScheduledSeq, SchedulerOutput


class SchedulingPolicy(Protocol):
    """What a scheduler plugin provides (kvloom/plugins/builtin/fcfs.py is the simplest one; most
    policies subclass ``RankedPolicy`` below).

    A policy may also define ``may_preempt(waiting, running) -> bool``: when the first request in
    waiting order cannot get KV blocks, the scheduler preempts ``select_victim(running, now)`` for it
    while ``may_preempt`` says yes. Without that method, waiting requests never preempt running ones.
    """

    name: str

    def waiting_order(self, waiting: list[Request], now: float) -> list[Request]:
        """The waiting requests (new and preempted) in the order they should be admitted. ``now`` is
        the scheduler's clock, comparable with ``Request.arrival_time``."""
        ...

    def select_victim(self, running: list[Request], now: float) -> Request:
        """The running request to preempt when KV blocks run out (it is recomputed later)."""
        ...


class RankedPolicy(abc.ABC):
    """A policy from one ranking: waiting requests are admitted in ascending ``rank`` and the running
    request with the highest rank is preempted first. Subclasses define ``name`` and ``rank``."""

    name: str

    @abc.abstractmethod
    def rank(self, request: Request, now: float) -> Any:
        """A sortable key; lower is admitted sooner and preempted later."""

    def waiting_order(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.rank(r, now))

    def select_victim(self, running: list[Request], now: float) -> Request:
        return max(running, key=lambda r: self.rank(r, now))


@dataclass(slots=True)
class FinishedUpdate:
    """What ``Scheduler.update`` reports per request that got tokens or finished."""

    request: Request
    new_token_ids: list[int]
    finished: RequestStatus | None
    num_draft_tokens: int = 0  # drafts verified in this step
    num_accepted_tokens: int = 0  # of which accepted


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        clock: Callable[[], float] = time.time,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.kv = kv
        # LoRA: a step's requests read at most max_loras adapters, each from its device slot.
        self.adapters = adapters
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache, and found, at each request's first admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Speculative decoding: drafts verified, accepted, and steps that verified any.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0
        self._step_id = 0
        self._launched: dict[int, list[Request]] = {}  # step id -> its requests, in plan order
        self._finished_ids: list[str] = []  # ended since the last plan (the runner drops their state)
        # Admission's hooks (core/engine/gate.py): a request's first step, and its end however it ends.
        self.on_first_step: Callable[[Request, float], None] | None = None
        self.on_finish: Callable[[Request], None] | None = None

    # ---------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish these requests (as aborted, or ``status``) and free their blocks; unknown ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status)
                aborted.append(req)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted: list[Request] = []
        now = self.clock()
        step_slots: set[int] = set()  # adapter slots this step reads
        loads: list[LoRALoad] = []

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.awaiting_final_token:
                continue  # preempted earlier in this loop, or its last token is already in flight
            if req.lora_id and not self._take_slot(req, step_slots, loads, new=False):
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)  # its drafts come last, below
            while not self.kv.allocate_slots(req, num_new):
                victim = self.policy.select_victim(self.running, now)
                budget += self._preempt(victim, preempted, scheduled)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = (req, num_new)
                budget -= num_new

        if not preempted:
            for req in self.policy.waiting_order(self.waiting, now):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if req.has_placeholder:
                    continue  # preempted while its newest token was in flight: back once it lands
                if req.lora_id and not self._take_slot(req, step_slots, loads):
                    continue  # its adapter is loading, or waits for a slot: the others go on
                req.spec_token_ids = []  # a (re)admitted request computes its known tokens first
                computed = self.kv.get_computed_blocks(req)
                num_computed = len(computed) * self.kv.block_size
                num_new = min(req.num_tokens - num_computed, budget)
                fits = self.kv.allocate_slots(req, num_new, computed)
                while not fits and (victim := self._admission_victim(req, now)) is not None:
                    budget += self._preempt(victim, preempted, scheduled)
                    fits = self.kv.allocate_slots(req, num_new, computed)
                if not fits:
                    break  # the head of the queue waits for blocks; nobody jumps it
                self._admit(req, num_computed, now)
                scheduled[req.request_id] = (req, num_new)
                budget -= num_new

        # Blocks are short when someone was preempted: drafts wait for a step with spare ones.
        self._schedule_drafts(scheduled, 0 if preempted else budget)
        self._step_id += 1
        if self.adapters is not None:
            self.adapters.end_step({r.lora_slot for r, _ in scheduled.values() if r.lora_id})
            waiting_for = self.adapters.draining_for
            if waiting_for is not None and not any(r.lora_id == waiting_for for r in self.waiting):
                self.adapters.release_draining()  # its requests ended (aborted, expired) before it got a slot
        plan = SchedulerOutput(self._step_id, [self._scheduled_seq(r, n) for r, n in scheduled.values()],
                               self._finished_ids, [r.request_id for r in preempted], loads)
        self._finished_ids = []
        self._launched[plan.step_id] = [r for r, _ in scheduled.values()]
        return plan

    def _take_slot(self, req: Request, step_slots: set[int], loads: list[LoRALoad], new: bool = True) -> bool:
        """Whether ``req``'s adapter is in a device slot it can read this step (``req.lora_slot``); if not,
        a load may have been planned and the request sits this step out."""
        slot = self.adapters.slot_for(req.lora_id, step_slots, loads,
                                      lambda: {r.lora_id for r in self.running if r.lora_id}, new)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _schedule_drafts(self, scheduled: dict[str, tuple[Request, int]], budget: int) -> None:
        """Give draft tokens to verify what the step budget has left once every known token (running
        requests' and the admitted prefill) has its share: drafts never displace a prefill chunk, and
        never preempt anyone (without spare blocks a request verifies nothing this step)."""
        for rid, (req, num_new) in list(scheduled.items()):
            if not req.spec_token_ids:
                continue
            extra = min(len(req.spec_token_ids), budget)
            whole = num_new == req.num_tokens - req.num_computed_tokens  # drafts follow the newest token
            if not extra or not whole or not self.kv.allocate_slots(req, num_new + extra):
                req.spec_token_ids = []
                continue
            req.spec_token_ids = req.spec_token_ids[:extra]
            scheduled[rid] = (req, num_new + extra)
            budget -= extra

    def plain_step_tokens(self) -> int:
        """About how many tokens the next step computes without drafts: the known tokens of running
        requests, then the prefill of the waiting requests that the free blocks and ``max_num_seqs``
        admit, in admission order, within ``max_num_batched_tokens`` (prefix-cache hits not counted)."""
        budget = self.max_num_batched_tokens
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.running if not r.awaiting_final_token)
        free, seats = self.kv.num_free_blocks(), self.max_num_seqs - len(self.running)
        if tokens < budget and seats > 0 and self.waiting:
            for req in self.policy.waiting_order(self.waiting, self.clock()):
                need = self.kv.blocks_for(min(req.num_tokens, budget - tokens))
                if seats == 0 or tokens >= budget or need > free:
                    break
                tokens += req.num_tokens - req.num_computed_tokens
                free, seats = free - need, seats - 1
        return min(tokens, budget)

    def _scheduled_seq(self, req: Request, num_new: int) -> ScheduledSeq:
        # Runs for every scheduled request of every step: plain attributes and positional fields only.
        start = req.num_computed_tokens
        end = start + num_new
        all_ids = req.all_token_ids
        num_tokens = len(all_ids)
        sampling = req.sampling
        if end <= num_tokens:  # no drafts
            drafts = []
            tokens = all_ids[start:end]
            placeholders = end - max(start, num_tokens - req.num_unresolved)
        else:
            drafts = req.spec_token_ids[: end - num_tokens]
            tokens = all_ids[start:num_tokens] + drafts
            placeholders = num_tokens - max(start, num_tokens - req.num_unresolved)
        seq = ScheduledSeq(
            req.request_id, tokens, start, req.block_ids.copy(), 1 + len(drafts) if end >= num_tokens else 0,
            sampling, drafts, placeholders if placeholders > 0 else 0, len(req.output_token_ids),
            (req.eos_token_ids + tuple(req.stop_token_ids)) if sampling.min_tokens else (),
            tuple(all_ids) if sampling.uses_penalties else None, len(req.prompt_token_ids),
            lora_slot=req.lora_slot, pooling=req.pooling,
        )
        if req.extra_block_ids:
            seq.extra_block_ids = [t.copy() for t in req.extra_block_ids]
        return seq

    def _admit(self, req: Request, num_computed: int, now: float) -> None:
        self.waiting.remove(req)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_computed
            if self.kv.prefix_cache is not None:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_computed
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            if self.on_first_step is not None:
                self.on_first_step(req, now)
        self.running.append(req)

    def _admission_victim(self, req: Request, now: float) -> Request | None:
        """The running request that ``req`` may preempt to get blocks, if the policy allows one."""
        may_preempt = getattr(self.policy, "may_preempt", None)
        if may_preempt is None or not self.running:
            return None
        victim = self.policy.select_victim(self.running, now)
        return victim if may_preempt(req, victim) else None

    def _preempt(self, req: Request, preempted: list[Request], scheduled: dict[str, tuple[Request, int]]) -> int:
        """Free a running request's blocks and send it back to wait (it is recomputed later); returns
        the budget it gives back if it was already scheduled in this step."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        preempted.append(req)
        undone = scheduled.pop(req.request_id, None)
        return undone[1] if undone is not None else 0

    # ---------------------------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, output: RunnerOutput) -> list[FinishedUpdate]:
        """Advance each scheduled request by its tokens, append sampled tokens, finish the stopped ones."""
        self.advance(plan)
        return self.resolve(plan, output)

    def advance(self, plan: SchedulerOutput) -> None:
        """What a step does regardless of the tokens it samples: its input tokens are computed, and each
        sampling request gets a placeholder for its new token. Called as soon as the step is launched,
        so the next step can be scheduled while this one runs on the GPU."""
        running, max_model_len = RequestStatus.RUNNING, self.max_model_len
        for s, req in zip(plan.seqs, self._launched[plan.step_id]):
            if req.status is not running:
                continue
            req.num_computed_tokens += len(s.token_ids)
            if s.num_sample_rows:
                if req.spec_token_ids:
                    req.spec_token_ids = []  # being verified now
                req.append_token(PLACEHOLDER)
                req.num_unresolved += 1
                # A step that verifies drafts is never overlapped, so only plain steps need the flag.
                if not s.draft_token_ids and (len(req.output_token_ids) >= req.max_tokens
                                              or len(req.all_token_ids) >= max_model_len):
                    req.awaiting_final_token = True

    def resolve(self, plan: SchedulerOutput, output: RunnerOutput) -> list[FinishedUpdate]:
        """Write in the tokens a step sampled (accepted drafts, then the target's token), roll back the
        rejected drafts, offer full blocks of accepted tokens to the prefix cache, and finish the
        requests that stopped. Tokens of requests that finished meanwhile are dropped."""
        updates = []
        caching = self.kv.prefix_cache is not None  # else cache_blocks does nothing: not called at all
        block_size, sampled, max_model_len = self.kv.block_size, output.sampled_token_ids, self.max_model_len
        for s, req in zip(plan.seqs, self._launched.pop(plan.step_id)):
            if req.status.finished:
                continue
            running = req.status is RequestStatus.RUNNING
            computed_end = s.start_pos + len(s.token_ids)
            if s.pooling is not None and s.num_sample_rows:  # its prompt is pooled: done, nothing sampled
                req.truncate(req.num_prompt_tokens)
                req.num_unresolved = 0
                if caching and running and len(req.block_ids) * block_size >= computed_end:
                    self.kv.cache_blocks(req, s.num_new_tokens, end=computed_end)
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                updates.append(FinishedUpdate(req, [], RequestStatus.FINISHED_STOPPED))
                continue
            if not s.num_sample_rows:
                if caching and running and len(req.block_ids) * block_size >= computed_end:
                    self.kv.cache_blocks(req, s.num_new_tokens, end=computed_end)
                continue
            tokens = sampled[s.request_id]
            num_drafts, accepted = len(s.draft_token_ids), len(tokens) - 1
            index = computed_end - num_drafts  # where this step's first new token goes
            if num_drafts:
                if req.num_tokens != index + 1:
                    raise RuntimeError(f"request {req.request_id!r}: drafts were verified behind a later step")
                self._count_drafts(req, num_drafts, accepted)
                computed_end -= num_drafts - accepted
                if running:
                    req.num_computed_tokens = computed_end
                    # Blocks that only rejected drafts reached go back now; slots of rejected drafts in
                    # kept blocks are overwritten by the next tokens and never cached.
                    self.kv.trim(req, index + len(tokens))
            req.set_token(index, tokens[0])
            req.num_unresolved -= 1
            if accepted:
                for t in tokens[1:]:
                    req.append_token(t)
            if caching and running and len(req.block_ids) * block_size >= computed_end:
                self.kv.cache_blocks(req, computed_end - s.start_pos, end=computed_end)
            finished, new = None, tokens
            for i in range(len(tokens)):
                finished = req.check_stop(index + i)
                if finished is None and index + i + 1 >= max_model_len:
                    finished = RequestStatus.FINISHED_LENGTH
                if finished is not None:
                    new = tokens[: i + 1]
                    req.truncate(index + i + 1)
                    self._finish(req, finished)
                    break
            updates.append(FinishedUpdate(req, new, finished, num_drafts, accepted))
        return updates

    def _count_drafts(self, req: Request, num_drafts: int, accepted: int) -> None:
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += accepted
        req.num_spec_steps += 1
        # A quarter weight for the newest step: at 80% per-token acceptance, a run of unlucky steps rarely
        # stops a request's drafts (a half weight stopped them often enough to cost a fifth of the speed-up).
        req.recent_acceptance = 0.75 * req.recent_acceptance + 0.25 * accepted / num_drafts
        if accepted:
            req.spec_failed_probes = 0
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.num_spec_steps += 1

    def decoding(self) -> list[Request]:
        """Running requests whose every known token but the newest is computed (and none in flight):
        the ones a proposer may draft for."""
        return [r for r in self.running
                if r.num_computed_tokens == r.num_tokens - 1 and not r.num_unresolved and not r.awaiting_final_token
                and r.pooling is None]  # a pooling request samples nothing to draft after

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        else:
            return  # already finished
        self.kv.free(req)
        req.spec_token_ids = []
        req.status = status
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if self.on_finish is not None:
            self.on_finish(req)

    def expire(self, first_token_s: float = 0.0) -> list[tuple[Request, str]]:
        """End the requests past a deadline, before a step is spent on them: waiting ones past their
        queue deadline (never started) or run deadline, running ones past their run deadline; their
        blocks are freed. Returns each with ``queue_timeout`` or ``deadline``.

        ``first_token_s`` is how long a request scheduled now takes to get its first token out (the
        engine's recent step time): a waiting request whose queue deadline passes before then cannot
        make it, so it goes now and gives its turn to one that can."""
        now = self.clock()
        expired = []
        for req in [*self.waiting, *self.running]:
            if (req.queue_deadline is not None and req.first_scheduled_time is None
                    and now + first_token_s > req.queue_deadline):
                expired.append((req, "queue_timeout"))
            elif req.deadline is not None and now > req.deadline:
                expired.append((req, "deadline"))
        for req, _ in expired:
            self._finish(req, RequestStatus.FINISHED_ERROR)
        return expired
