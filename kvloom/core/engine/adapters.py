"""The engine's LoRA bookkeeping (no tensors): which adapters are loaded, by name, and which device slot
each holds. The scheduler asks ``slot_for`` when it schedules a request of an adapter: a resident, loaded
adapter gets its slot; one that is not resident takes a free slot, or the least recently used one whose
adapter no running request needs, and the plan carries the load; its requests wait (without holding
up anyone else) until the runner reports the slot filled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvloom.core.engine.step import LoRALoad


class AdapterInUse(ValueError):
    """Unloading an adapter that unfinished requests still run with (the engine's utility answers it as a
    ``conflict``)."""

    error_kind = "conflict"


@dataclass
class Adapter:
    id: int
    name: str
    path: str
    key: str  # digest of its weights and config: prefix-cache blocks are keyed by it
    rank: int
    targets: list[str]


class AdapterSlots:
    """Loaded adapters and the ``max_loras`` device slots. ``is_ready(slot)`` is the runner's word on a
    slot's load; slots read by the previous plan (which may still run) are never given to another adapter."""

    def __init__(self, max_loras: int, is_ready: Callable[[int], bool]) -> None:
        self.max_loras = max_loras
        self.is_ready = is_ready
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}
        self._next_id = 1  # 0 is the base model
        self.slot_adapter: list[int | None] = [None] * max_loras
        self.slot_of: dict[int, int] = {}
        self.loading: set[int] = set()
        self.last_used = [0] * max_loras
        self.protected: set[int] = set()
        # A busy slot that admits no new request: a waiting adapter found every slot busy, and takes this
        # one once its running requests are done (else requests of resident adapters could starve it).
        self.draining: int | None = None
        self.draining_for: int | None = None  # the adapter waiting for it
        self._clock = 0
        self.num_loads = 0  # slot loads planned since the engine started

    # --- the registry ------------------------------------------------------------------------------
    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def add(self, adapter: Adapter) -> None:
        self.by_name[adapter.name] = adapter
        self.by_id[adapter.id] = adapter

    def remove(self, name: str) -> Adapter:
        adapter = self.by_name.pop(name)
        del self.by_id[adapter.id]
        slot = self.slot_of.pop(adapter.id, None)
        if slot is not None:
            self.slot_adapter[slot] = None
            self.loading.discard(slot)
            if slot == self.draining:
                self.release_draining()
        if adapter.id == self.draining_for:
            self.release_draining()
        return adapter

    # --- slots -------------------------------------------------------------------------------------
    def slot_for(self, adapter_id: int, step_slots: set[int], loads: list[LoRALoad],
                 busy: Callable[[], set[int]], new: bool = True) -> int | None:
        """The slot a request of ``adapter_id`` reads in this step, or None when it must wait: its adapter is
        still loading, or no slot can be freed for it now (then a load may have been added to ``loads``).
        ``busy()`` gives the adapters that running requests need (asked only when a slot must be freed);
        ``new``: the request is not running yet (a draining slot admits none)."""
        slot = self.slot_of.get(adapter_id)
        if slot is not None:
            if new and slot == self.draining:
                return None
            if slot in self.loading:
                # A load this plan carries has not even started: its requests run in a later step.
                if any(load.slot == slot for load in loads) or not self.is_ready(slot):
                    return None
                self.loading.discard(slot)
            self._clock += 1
            self.last_used[slot] = self._clock
            step_slots.add(slot)
            return slot
        victim = self._victim(step_slots, busy)
        if victim is None:
            if self.draining is None:
                held = [s for s in range(self.max_loras) if s not in self.loading and self.slot_adapter[s] is not None]
                if held:
                    self.draining = min(held, key=self.last_used.__getitem__)
                    self.draining_for = adapter_id
            return None
        if adapter_id == self.draining_for:
            self.release_draining()
        old = self.slot_adapter[victim]
        if old is not None:
            del self.slot_of[old]
        adapter = self.by_id[adapter_id]
        self.slot_adapter[victim] = adapter_id
        self.slot_of[adapter_id] = victim
        self.loading.add(victim)
        self.num_loads += 1
        loads.append(LoRALoad(victim, adapter_id, adapter.name, adapter.path))
        return None

    def _victim(self, step_slots: set[int], busy: Callable[[], set[int]]) -> int | None:
        free = [s for s in range(self.max_loras) if self.slot_adapter[s] is None and s not in self.protected]
        if free:
            return free[0]
        needed = busy()
        candidates = [s for s in range(self.max_loras)
                      if s not in step_slots and s not in self.protected and s not in self.loading
                      and self.slot_adapter[s] not in needed]
        return min(candidates, key=self.last_used.__getitem__) if candidates else None

    def release_draining(self) -> None:
        """The adapter waiting for the draining slot got one, or no longer waits (or the slot's adapter is gone)."""
        self.draining = self.draining_for = None

    def cancel_load(self, load: LoRALoad) -> None:
        """A planned load that cannot happen (the adapter's folder is gone): its slot is free again."""
        self.slot_adapter[load.slot] = None
        self.slot_of.pop(load.adapter_id, None)
        self.loading.discard(load.slot)

    def end_step(self, step_slots: set[int]) -> None:
        """The plan just made reads ``step_slots``: keep them from other adapters while it may run."""
        self.protected = step_slots

    def resident(self) -> dict[str, int]:
        """Loaded-and-ready adapters by name -> slot (for stats and tests)."""
        return {self.by_id[a].name: s for a, s in self.slot_of.items() if s not in self.loading}
