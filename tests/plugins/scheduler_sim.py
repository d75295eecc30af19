"""Driving a ``Scheduler`` without a model: fake requests, a fake clock, and steps that "sample" token 7."""

from __future__ import annotations

from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import Scheduler
from kvloom.core.engine.step import RunnerOutput, SchedulerOutput
from kvloom.core.sampling_params import SamplingParams
from kvloom.plugins.builtin.free_list import FreeListAllocator


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(policy, *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, clock: FakeClock | None = None) -> Scheduler:
    kv = KVCacheManager(FreeListAllocator(num_blocks), block_size)
    return Scheduler(kv, policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=100_000, clock=clock or FakeClock())


def add(sched: Scheduler, rid: str, prompt_len: int, *, max_tokens: int = 4, priority: int = 0) -> Request:
    req = Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  priority=priority, arrival_time=sched.clock(), max_tokens=max_tokens)
    sched.add_request(req)
    return req


def sampled(plan: SchedulerOutput, token=lambda: 7) -> RunnerOutput:
    """What a runner would return: one new token for every sequence that samples."""
    return RunnerOutput({s.request_id: [token()] for s in plan.seqs if s.samples})


def step(sched: Scheduler) -> SchedulerOutput:
    plan = sched.schedule()
    sched.update(plan, sampled(plan))
    return plan


def admission_order(sched: Scheduler, max_steps: int = 1000) -> list[str]:
    """Request ids in the order they are first scheduled, running until every request finished."""
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return order
        for s in step(sched).seqs:
            if s.request_id not in order:
                order.append(s.request_id)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
