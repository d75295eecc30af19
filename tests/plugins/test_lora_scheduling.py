"""The scheduler's LoRA bookkeeping without a model (``kvloom.core.engine.adapters``): at most max_loras
adapters a step, a request whose adapter is loading waits without holding up the others, slots of adapters
that running requests need (or that the step in flight reads) are never taken, the least recently used
idle one is."""

from __future__ import annotations

from kvloom.core.engine.adapters import Adapter, AdapterSlots
from kvloom.plugins.builtin.fcfs import FCFSPolicy
from tests.plugins.scheduler_sim import add, make_scheduler, sampled


def _setup(max_loras: int, names=("a", "b", "c")):
    loading = set()  # slots whose load the fake runner has not finished
    slots = AdapterSlots(max_loras, lambda slot: slot not in loading)
    for name in names:
        slots.add(Adapter(slots.new_id(), name, f"/adapters/{name}", f"key-{name}", 4, ["q_proj"]))
    sched = make_scheduler(FCFSPolicy())
    sched.adapters = slots
    return sched, slots, loading


def _lora(req, slots, name):
    adapter = slots.by_name[name]
    req.lora_id, req.lora_name, req.lora_key = adapter.id, name, adapter.key
    return req


def _run(sched, plan, loading):
    for load in plan.lora_loads:
        loading.add(load.slot)
    sched.update(plan, sampled(plan))


def test_a_loading_adapter_holds_up_only_its_own_requests():
    sched, slots, loading = _setup(2)
    _lora(add(sched, "r-a", 4, max_tokens=3), slots, "a")
    add(sched, "base", 4, max_tokens=3)
    plan = sched.schedule()
    assert [s.request_id for s in plan.seqs] == ["base"]  # the base request runs while a loads
    assert [(load.slot, load.name) for load in plan.lora_loads] == [(0, "a")]
    _run(sched, plan, loading)
    plan = sched.schedule()
    assert "r-a" not in [s.request_id for s in plan.seqs] and not plan.lora_loads  # still loading
    _run(sched, plan, loading)
    loading.clear()  # the runner says the copy is done
    plan = sched.schedule()
    assert {s.request_id: s.lora_slot for s in plan.seqs}["r-a"] == 0


def test_at_most_max_loras_adapters_a_step_and_busy_slots_are_never_taken():
    sched, slots, loading = _setup(1)
    for name in ("a", "b"):
        for i in range(2):
            _lora(add(sched, f"{name}{i}", 3, max_tokens=4), slots, name)
    seen = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        seen.append({s.lora_slot for s in plan.seqs if s.lora_slot >= 0})
        running_adapters = {r.lora_name for r in sched.running}
        assert len(running_adapters) <= 1  # b's load never takes a's slot while a's requests run
        loading.clear()
        _run(sched, plan, loading)
    assert not sched.has_unfinished()
    assert max(len(s) for s in seen) == 1
    assert slots.num_loads == 2  # a, then b once a's requests were done (not one load per step)


def test_the_least_recently_used_idle_slot_goes_and_the_in_flight_plans_slots_stay():
    sched, slots, loading = _setup(2)
    r_a = _lora(add(sched, "a0", 2, max_tokens=1), slots, "a")
    r_b = _lora(add(sched, "b0", 2, max_tokens=1), slots, "b")
    plan = sched.schedule()
    _run(sched, plan, loading)
    loading.clear()
    plan = sched.schedule()  # both run (and finish: one token each)
    assert {s.request_id for s in plan.seqs} == {"a0", "b0"}
    assert r_a.lora_slot != r_b.lora_slot
    sched.advance(plan)  # launched: the next plan is made while it runs (async scheduling)
    _lora(add(sched, "c0", 2, max_tokens=1), slots, "c")
    # c's load may not take a slot the plan in flight reads.
    blocked = sched.schedule()
    assert not blocked.seqs and not blocked.lora_loads
    sched.resolve(plan, sampled(plan))  # a0 and b0 finish
    sched.update(blocked, sampled(blocked))
    load = sched.schedule().lora_loads
    assert [(x.name, x.slot) for x in load] == [("c", r_a.lora_slot)]  # a was used less recently than b
    assert slots.resident() == {"b": r_b.lora_slot}


def test_a_waiting_adapter_is_not_starved_by_new_requests_of_a_resident_one():
    sched, slots, loading = _setup(1)
    _lora(add(sched, "a0", 2, max_tokens=3), slots, "a")
    for _ in range(2):  # a0 loads, then runs
        plan = sched.schedule()
        loading.clear()
        _run(sched, plan, loading)
    _lora(add(sched, "b0", 2, max_tokens=2), slots, "b")  # finds the one slot busy
    _lora(add(sched, "a1", 2, max_tokens=2), slots, "a")  # arrives later: a's slot would admit it at once
    order = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        order += [s.request_id for s in plan.seqs if s.request_id not in order]
        loading.clear()
        _run(sched, plan, loading)
    assert order.index("b0") < order.index("a1")  # a's slot drained for b, then a came back
    assert slots.draining is None and not sched.has_unfinished()


def test_a_drained_slot_opens_again_when_the_waiting_adapter_stops_waiting():
    sched, slots, loading = _setup(1)
    _lora(add(sched, "a0", 2, max_tokens=3), slots, "a")
    for _ in range(2):
        plan = sched.schedule()
        loading.clear()
        _run(sched, plan, loading)
    _lora(add(sched, "b0", 2, max_tokens=2), slots, "b")
    _run(sched, sched.schedule(), loading)
    assert slots.draining is not None
    sched.abort(["b0"])  # the client went away
    _lora(add(sched, "a1", 2, max_tokens=2), slots, "a")
    _run(sched, sched.schedule(), loading)
    assert slots.draining is None
    plan = sched.schedule()
    assert "a1" in [s.request_id for s in plan.seqs]
