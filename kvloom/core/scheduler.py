"""Continuous batching by token counts: each step gives running requests, then waiting ones, as many
tokens as the budget allows. Pure bookkeeping: no tensors here."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvloom.core.kv_cache import KVCacheManager
from kvloom.core.request import PLACEHOLDER, Request, RequestStatus


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


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool  # this step completes the known tokens, so a new token is sampled
    computed_end: int = 0  # num_computed_tokens after this step (set by Scheduler.advance)
    token_index: int = -1  # where this step's sampled token goes in all_token_ids (set by advance)


@dataclass
class SchedulerPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class FinishedUpdate:
    """What ``Scheduler.update`` reports per request that got a token or finished."""

    request: Request
    new_token_ids: list[int]
    finished: RequestStatus | None


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
    ) -> None:
        self.kv = kv
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

    # ---------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks; unknown ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        now = self.clock()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.awaiting_final_token:
                continue  # preempted earlier in this loop, or its last token is already in flight
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.policy.select_victim(self.running, now)
                budget += self._preempt(victim, plan, scheduled)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = ScheduledRequest(req, num_new, self._samples(req, num_new))
                budget -= num_new

        if not plan.preempted:
            for req in self.policy.waiting_order(self.waiting, now):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if req.has_placeholder:
                    continue  # preempted while its newest token was in flight: back once it lands
                computed = self.kv.get_computed_blocks(req)
                num_computed = len(computed) * self.kv.block_size
                num_new = min(req.num_tokens - num_computed, budget)
                fits = self.kv.allocate_slots(req, num_new, computed)
                while not fits and (victim := self._admission_victim(req, now)) is not None:
                    budget += self._preempt(victim, plan, scheduled)
                    fits = self.kv.allocate_slots(req, num_new, computed)
                if not fits:
                    break  # the head of the queue waits for blocks; nobody jumps it
                self._admit(req, num_computed, now)
                scheduled[req.request_id] = ScheduledRequest(req, num_new, self._samples(req, num_new))
                budget -= num_new

        plan.scheduled = list(scheduled.values())
        return plan

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
        self.running.append(req)

    def _admission_victim(self, req: Request, now: float) -> Request | None:
        """The running request that ``req`` may preempt to get blocks, if the policy allows one."""
        may_preempt = getattr(self.policy, "may_preempt", None)
        if may_preempt is None or not self.running:
            return None
        victim = self.policy.select_victim(self.running, now)
        return victim if may_preempt(req, victim) else None

    @staticmethod
    def _samples(req: Request, num_new: int) -> bool:
        return req.num_computed_tokens + num_new == req.num_tokens

    def _preempt(self, req: Request, plan: SchedulerPlan, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free a running request's blocks and send it back to wait (it is recomputed later); returns
        the budget it gives back if it was already scheduled in this step."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        plan.preempted.append(req)
        undone = scheduled.pop(req.request_id, None)
        return undone.num_new_tokens if undone is not None else 0

    # ---------------------------------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled: dict[str, list[int]]) -> list[FinishedUpdate]:
        """Advance each scheduled request by its tokens, append sampled tokens, finish the stopped ones."""
        self.advance(plan)
        return self.resolve(plan, sampled)

    def advance(self, plan: SchedulerPlan) -> None:
        """What a step does regardless of the tokens it samples: its input tokens are computed, and each
        sampling request gets a placeholder for its new token. Called as soon as the step is launched,
        so the next step can be scheduled while this one runs on the GPU."""
        for s in plan.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            s.computed_end = req.num_computed_tokens
            if s.samples:
                req.append_token(PLACEHOLDER)
                s.token_index = req.num_tokens - 1
                if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                    req.awaiting_final_token = True

    def resolve(self, plan: SchedulerPlan, sampled: dict[str, list[int]]) -> list[FinishedUpdate]:
        """Write in the tokens a step sampled, offer its full blocks to the prefix cache, and finish
        the requests that stopped. Tokens of requests that finished meanwhile are dropped."""
        updates = []
        for s in plan.scheduled:
            req = s.request
            if req.status.finished:
                continue
            if req.status is RequestStatus.RUNNING and len(req.block_ids) * self.kv.block_size >= s.computed_end:
                self.kv.cache_blocks(req, s.num_new_tokens, end=s.computed_end)
            if not s.samples:
                continue
            token = sampled[req.request_id][0]
            req.set_token(s.token_index, token)
            finished = req.check_stop(s.token_index)
            if finished is None and s.token_index + 1 >= self.max_model_len:
                finished = RequestStatus.FINISHED_LENGTH
            if finished is not None:
                req.truncate(s.token_index + 1)
                self._finish(req, finished)
            updates.append(FinishedUpdate(req, [token], finished))
        return updates

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        else:
            return  # already finished
        self.kv.free(req)
        req.status = status
        del self.requests[req.request_id]
