"""Continuous batching by token counts: each step gives running requests, then waiting ones, as many
tokens as the budget allows. Pure bookkeeping: no tensors here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from kvloom.core.kv_cache import KVCacheManager
from kvloom.core.request import Request, RequestStatus


class SchedulingPolicy(Protocol):
    """What a scheduler plugin provides: the order of the waiting queue and the preemption victim."""

    name: str

    def waiting_order(self, waiting: list[Request], now: float) -> list[Request]:
        """The waiting requests in the order they should be admitted."""
        ...

    def select_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""
        ...


class FCFSPolicy:
    """First come, first served; the newest running request is preempted first."""

    name = "fcfs"

    def waiting_order(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_order)

    def select_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: r.arrival_order)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool  # this step completes the known tokens, so a new token is sampled


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
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

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

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.policy.select_victim(self.running)
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = ScheduledRequest(req, num_new, self._samples(req, num_new))
                budget -= num_new

        if not plan.preempted:
            now = time.time()
            for req in self.policy.waiting_order(self.waiting, now):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                computed = self.kv.get_computed_blocks(req)
                num_computed = len(computed) * self.kv.block_size
                num_new = min(req.num_tokens - num_computed, budget)
                if not self.kv.allocate_slots(req, num_new, computed):
                    break  # the head of the queue waits for blocks; nobody jumps it
                self.waiting.remove(req)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_computed
                req.num_computed_tokens = num_computed
                req.status = RequestStatus.RUNNING
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                self.running.append(req)
                scheduled[req.request_id] = ScheduledRequest(req, num_new, self._samples(req, num_new))
                budget -= num_new

        plan.scheduled = list(scheduled.values())
        return plan

    @staticmethod
    def _samples(req: Request, num_new: int) -> bool:
        return req.num_computed_tokens + num_new == req.num_tokens

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    # ---------------------------------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled: dict[str, list[int]]) -> list[FinishedUpdate]:
        """Advance each scheduled request by its tokens, append sampled tokens, finish the stopped ones."""
        updates = []
        for s in plan.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req)
            if not s.samples:
                continue
            new_tokens = []
            finished = None
            for token in sampled[req.request_id]:
                req.append_token(token)
                new_tokens.append(token)
                finished = req.check_stop()
                if finished is None and req.num_tokens >= self.max_model_len:
                    finished = RequestStatus.FINISHED_LENGTH
                if finished is not None:
                    self._finish(req, finished)
                    break
            updates.append(FinishedUpdate(req, new_tokens, finished))
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
