"""EngineCore's LoRA adapter management: loading, unloading and listing adapters by name, re-reading one the
host LRU let go before a step's slot load, and the per-adapter request counts of the engine's stats."""

from __future__ import annotations

import logging

from kvloom.core.engine.adapters import AdapterInUse
from kvloom.core.engine.request import RequestStatus
from kvloom.core.engine.step import SchedulerOutput
from kvloom.core.messages import TokenDelta

logger = logging.getLogger("kvloom")


class LoRAAdapterMethods:
    """Mixed into EngineCore: uses its ``lora`` (the LoRAPool, None with LoRA off), ``adapters``
    (AdapterSlots), ``scheduler`` and ``structured``."""

    def _check_lora_enabled(self) -> None:
        if self.adapters is None:
            raise ValueError("LoRA is off in this engine: start it with --enable-lora to load adapters")

    def load_lora_adapter(self, name: str, path: str) -> dict:
        """Read and check the PEFT adapter at ``path`` and serve it as ``name`` (its weights reach a device
        slot when a request needs them); ValueError naming what is wrong."""
        from kvloom.core.engine.adapters import Adapter

        self._check_lora_enabled()
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("a LoRA adapter needs a non-empty name and path")
        if name in self.adapters.by_name:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {self.adapters.by_name[name].path!r}); "
                             "unload it first")
        adapter_id = self.adapters.new_id()
        weights = self.lora.read(adapter_id, name, path)
        adapter = Adapter(adapter_id, name, path, weights.digest, weights.rank, weights.targets)
        self.adapters.add(adapter)
        logger.info("LoRA adapter %r loaded from %s: rank %d on %s", name, path, adapter.rank,
                    ", ".join(adapter.targets))
        return self._adapter_card(adapter)

    def unload_lora_adapter(self, name: str) -> dict:
        """Stop serving adapter ``name``. Refused (ValueError) while requests of it are unfinished: none of
        them is cut short; unload again once they are done."""
        self._check_lora_enabled()
        adapter = self.adapters.by_name.get(name)
        if adapter is None:
            raise LookupError(f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters.by_name) or 'none'}")
        users = [r for r in [*self.scheduler.requests.values(), *self.structured.pending_requests()]
                 if r.lora_id == adapter.id]
        if users:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s); it was not "
                             "unloaded (unload it again once they finish)")
        self.adapters.remove(name)
        self.lora.forget(adapter.id)
        logger.info("LoRA adapter %r unloaded", name)
        return self._adapter_card(adapter)

    def _read_adapters(self, plan: SchedulerOutput) -> list[TokenDelta]:
        """Make sure each adapter the plan loads is in host memory, read again from its folder if the host
        LRU let it go; an adapter that cannot be read any more fails its requests (the engine runs on)."""
        from kvloom.core.model.lora import LoRAError

        deltas = []
        for load in list(plan.lora_loads):
            try:
                self.lora.prefetch(load.adapter_id, load.name, load.path)
            except LoRAError as e:
                plan.lora_loads.remove(load)
                self.adapters.cancel_load(load)
                users = [r.request_id for r in self.scheduler.waiting if r.lora_id == load.adapter_id]
                logger.error("LoRA adapter %r cannot be read again; failing its %d waiting request(s): %s",
                             load.name, len(users), e)
                self.structured.remove(users)
                for req in self.scheduler.abort(users, RequestStatus.FINISHED_ERROR):
                    deltas.append(TokenDelta(request_id=req.request_id, new_token_ids=[], finish_reason="error",
                                             error=str(e), error_kind="rejected",
                                             num_prompt_tokens=req.num_prompt_tokens))
        return deltas

    def list_lora_adapters(self) -> list[dict]:
        return [self._adapter_card(a) for a in self.adapters.by_name.values()] if self.adapters is not None else []

    @staticmethod
    def _adapter_card(adapter) -> dict:
        return {"name": adapter.name, "path": adapter.path, "rank": adapter.rank, "targets": adapter.targets}

    def _lora_stats(self) -> dict:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for counts, reqs in ((running, self.scheduler.running), (waiting, self.scheduler.waiting)):
            for r in reqs:
                if r.lora_id:
                    counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        return dict(lora_running=running, lora_waiting=waiting, lora_loaded=len(self.adapters.by_name),
                    lora_slot_loads=self.adapters.num_loads)
