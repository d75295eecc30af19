"""Scheduler plugins: priority order and preemption of lower priority first; shortest prompt first with
aging, so a long prompt still finishes under a steady stream of short ones."""

from __future__ import annotations

from kvloom import LLM, SamplingParams
from kvloom.plugins.builtin.fcfs import FCFSPolicy
from kvloom.plugins.builtin.priority import PriorityPolicy
from kvloom.plugins.builtin.sjf import ShortestPromptFirstPolicy
from tests.plugins.scheduler_sim import FakeClock, add, admission_order, make_scheduler, step


def test_priority_order_is_honoured():
    sched = make_scheduler(PriorityPolicy(), max_num_seqs=1)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2), ("high2", 0)]:
        add(sched, rid, 6, priority=prio)
    assert admission_order(sched) == ["high", "high2", "mid", "low"]
    fcfs = make_scheduler(FCFSPolicy(), max_num_seqs=1)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        add(fcfs, rid, 6, priority=prio)
    assert admission_order(fcfs) == ["low", "high", "mid"]


def _first_victim(policy) -> str:
    # Three 4-token prompts in 5 blocks of 4: after their first decode block, the pool runs dry.
    sched = make_scheduler(policy, num_blocks=5)
    for rid, prio in [("a", 0), ("b", 2), ("c", 1)]:
        add(sched, rid, 4, max_tokens=12, priority=prio)
    for _ in range(20):
        plan = step(sched)
        if plan.preempted_request_ids:
            return plan.preempted_request_ids[0]
    raise AssertionError("nothing was preempted")


def test_lower_priority_is_preempted_first():
    assert _first_victim(PriorityPolicy()) == "b"  # priority 2 is the lowest
    assert _first_victim(FCFSPolicy()) == "c"  # the newest


def _high_priority_arrives(policy):
    sched = make_scheduler(policy, num_blocks=4)
    add(sched, "low1", 6, max_tokens=2, priority=5)
    add(sched, "low2", 6, max_tokens=2, priority=5)
    step(sched)  # both hold two blocks each: the pool is empty
    add(sched, "high", 4, priority=0)
    return step(sched)


def test_a_higher_priority_arrival_preempts_lower_priority_running_requests():
    plan = _high_priority_arrives(PriorityPolicy())
    assert plan.preempted_request_ids == ["low2"]
    assert sorted(s.request_id for s in plan.seqs) == ["high", "low1"]
    plan = _high_priority_arrives(PriorityPolicy(preempt_for_waiting=False))
    assert not plan.preempted_request_ids and "high" not in [s.request_id for s in plan.seqs]


def test_priority_through_the_offline_api(tiny_llama):
    llm = LLM(str(tiny_llama), plugins=["priority"], max_num_seqs=1, num_kv_blocks=32, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params, priority=[2, 0, 1], use_tqdm=False)
    first_tokens = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert first_tokens == [1, 2, 0]


def test_sjf_runs_short_prompts_first():
    sched = make_scheduler(ShortestPromptFirstPolicy(), max_num_seqs=1)
    for rid, n in [("long", 40), ("short", 8), ("mid", 20)]:
        add(sched, rid, n)
    assert admission_order(sched) == ["short", "mid", "long"]


def _long_prompt_under_short_load(aging: float, steps: int = 200) -> bool:
    """A 200-token prompt and a new 8-token prompt every 0.1 s, one sequence at a time (each short one
    takes two steps, so the queue keeps growing). True when the long prompt finished."""
    clock = FakeClock()
    sched = make_scheduler(ShortestPromptFirstPolicy(aging_tokens_per_s=aging), max_num_seqs=1, clock=clock)
    long = add(sched, "long", 200, max_tokens=2)
    for i in range(steps):
        add(sched, f"short{i}", 8, max_tokens=2)
        step(sched)
        clock.now += 0.1
    return long.status.finished


def test_sjf_aging_lets_a_long_prompt_finish_under_steady_short_load():
    assert _long_prompt_under_short_load(aging=100.0)
    assert not _long_prompt_under_short_load(aging=0.0)  # without aging it starves
