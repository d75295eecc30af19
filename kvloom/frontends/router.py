"""The engine router: one engine client's interface (``healthy``, ``num_in_flight``, ``generate``,
``utility``) over the data-parallel replicas of one model. A request goes to the replica that served
its prompt's first KV blocks (its prefix is cached there) unless that replica is overloaded, else to
the least-loaded one; a dead or hung replica is taken out until it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvloom.core.messages import EngineReady, EngineStats, TokenDelta
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.config import ROUTING_POLICIES
from kvloom.frontends.engine_client import AsyncEngineClient, EngineUnavailable

logger = logging.getLogger("kvloom.router")

AFFINITY_BLOCKS = 8  # prompt blocks the affinity table keys on: enough to tell system prompts apart
AFFINITY_TABLE_SIZE = 65536  # prefixes remembered (LRU); a forgotten one just routes by load again
# A prefix's replica keeps it while its load is within this of the least-loaded replica's (x2 + slack):
# a cache hit saves a prefill, but not a queue of requests waiting behind it.
OVERLOAD_FACTOR = 2.0
OVERLOAD_SLACK = 4
REJOIN_INTERVAL_S = 1.0


def prefix_keys(token_ids: list[int], block_size: int, max_blocks: int = AFFINITY_BLOCKS) -> list[bytes]:
    """Chained hashes of the prompt's first full blocks: key i stands for the whole prefix up to block
    i, like the prefix cache's block hashes (only prompts that fill a block have a key)."""
    keys, parent = [], b""
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class Replica:
    """One engine of the model, as this frontend sees it."""

    index: int
    address: str
    client: AsyncEngineClient
    num_routed: int = 0  # requests this frontend has sent here
    rejoining: asyncio.Task | None = field(default=None, repr=False)

    @property
    def load(self) -> tuple[int, float]:
        """Requests queued and running there (the engine's own count covers every frontend; this
        frontend's in-flight count covers requests sent since its last step), then KV-cache use."""
        stats = self.client.last_stats or EngineStats()
        return max(self.client.num_in_flight, stats.num_running + stats.num_waiting), stats.kv_usage


class EngineRouter:
    """Routes the requests of one model over its replicas; with one replica it is that engine client."""

    def __init__(self, addresses: list[str], *, heartbeat_timeout: float | None = None, secret: str | None = None,
                 policy: str = "prefix_affinity", frontend_id: str | None = None, reconnect: bool = False,
                 make_client: Callable[..., AsyncEngineClient] = AsyncEngineClient) -> None:
        if not addresses:
            raise ValueError("the engine router needs at least one engine address")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.frontend_id = frontend_id or f"fe{os.getpid()}-{secrets.token_hex(3)}"
        self._make_client = lambda address: make_client(address, frontend_id=self.frontend_id,
                                                        heartbeat_timeout=heartbeat_timeout, secret=secret,
                                                        reconnect=reconnect)
        self.replicas = [Replica(i, a, self._make_client(a)) for i, a in enumerate(addresses)]
        self.ready: EngineReady | None = None
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._turn = itertools.count()
        self._closed = False
        self._watcher: asyncio.Task | None = None

    # --- the engine client's interface --------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return any(r.client.healthy for r in self.replicas)

    @property
    def unavailable_reason(self) -> str | None:
        if self.healthy:
            return None
        if len(self.replicas) == 1:
            return self.replicas[0].client.unavailable_reason
        return f"all {len(self.replicas)} replicas are unavailable: " + "; ".join(
            f"replica {r.index}: {r.client.unavailable_reason}" for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.client.num_in_flight for r in self.replicas)

    @property
    def last_stats(self) -> EngineStats | None:
        return self.replicas[0].client.last_stats if len(self.replicas) == 1 else None

    async def start(self, timeout: float) -> EngineReady:
        """Wait for every replica to be ready; they must agree on what frontends validate against."""
        readies = await asyncio.gather(*(r.client.start(timeout) for r in self.replicas))
        first = readies[0]
        for r, ready in zip(self.replicas[1:], readies[1:]):
            for name in ("model_name", "max_model_len", "vocab_size", "block_size"):
                if getattr(ready, name) != getattr(first, name):
                    raise EngineUnavailable(f"replica {r.index} at {r.address} has {name}={getattr(ready, name)!r} "
                                            f"but replica 0 has {getattr(first, name)!r}: replicas of one model "
                                            "must be started alike")
        self.ready = first
        if len(self.replicas) > 1:
            self._watcher = asyncio.create_task(self._watch_replicas())
        return first

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in [self._watcher, *(r.rejoining for r in self.replicas)] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas), return_exceptions=True)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, arrival_time: float = 0.0, **admission: Any) -> AsyncIterator[TokenDelta]:
        """The request's deltas from the replica ``choose`` picks; closing early aborts it there.
        ``admission``: the deadlines and API-key name, passed on as the engine client takes them."""
        replica = self.choose(prompt_token_ids)
        replica.num_routed += 1
        deltas = replica.client.generate(request_id, prompt_token_ids, sampling, priority, arrival_time, **admission)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()

    async def utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        """Call ``method`` on every live replica: ``stats`` are summed (KV use averaged), other results
        come back as replica 0's would (``reset_prefix_cache`` is true when it was true everywhere)."""
        if len(self.replicas) == 1:
            return await self.replicas[0].client.utility(method, *args, timeout=timeout)
        live = self.live_replicas()
        if not live:
            raise EngineUnavailable(self.unavailable_reason)
        results = await asyncio.gather(*(r.client.utility(method, *args, timeout=timeout) for r in live))
        if method == "stats":
            return sum_stats(results)
        if all(isinstance(x, bool) for x in results):
            return all(results)
        return results[0]

    async def replica_stats(self, timeout: float = 5.0) -> list[tuple[int, bool, Any]]:
        """Each replica's (index, healthy, ``stats``), asked of every live one at once; ``stats`` is
        None for a replica that is out or did not answer within ``timeout``."""
        async def ask(replica: Replica) -> Any:
            if not replica.client.healthy:
                return None
            try:
                return await replica.client.utility("stats", timeout=timeout)
            except Exception:  # noqa: BLE001 - one replica's failure must not hide the others' figures
                return None

        results = await asyncio.gather(*(ask(r) for r in self.replicas))
        return [(r.index, r.client.healthy, stats) for r, stats in zip(self.replicas, results)]

    def end_all(self, reason: str) -> None:
        for r in self.replicas:
            r.client.end_all(reason)

    # --- routing -----------------------------------------------------------------------------------
    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.client.healthy]

    def choose(self, prompt_token_ids: list[int]) -> Replica:
        live = self.live_replicas()
        if not live:
            raise EngineUnavailable(self.unavailable_reason or "no replica is ready")
        if len(live) == 1:
            return live[0]
        if self.policy == "round_robin":
            return live[next(self._turn) % len(live)]
        least = min(live, key=lambda r: (r.load, r.num_routed))
        if self.policy == "least_loaded" or self.ready is None:
            return least
        keys = prefix_keys(prompt_token_ids, self.ready.block_size)
        owner = self._owner(keys)
        if owner is not None and owner.client.healthy and not self._overloaded(owner, least):
            chosen = owner
        else:
            chosen = least
        self._remember(keys, chosen.index, owner is None or not owner.client.healthy)
        return chosen

    def _owner(self, keys: list[bytes]) -> Replica | None:
        """The replica that served the longest of these prefixes."""
        for key in reversed(keys):
            index = self._affinity.get(key)
            if index is not None:
                self._affinity.move_to_end(key)
                return self.replicas[index]
        return None

    def _overloaded(self, replica: Replica, least: Replica) -> bool:
        return replica.load[0] > OVERLOAD_FACTOR * least.load[0] + OVERLOAD_SLACK

    def _remember(self, keys: list[bytes], index: int, take_over: bool) -> None:
        # An overflow to another replica does not move the prefix: its owner still holds it cached.
        for key in keys:
            if take_over or key not in self._affinity:
                self._affinity[key] = index
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_TABLE_SIZE:
            self._affinity.popitem(last=False)

    # --- health ------------------------------------------------------------------------------------
    def replica_states(self) -> list[dict[str, Any]]:
        """What /health reports per replica."""
        states = []
        for r in self.replicas:
            stats = r.client.last_stats or EngineStats()
            states.append({"replica": r.index, "healthy": r.client.healthy,
                           "reason": r.client.unavailable_reason, "num_routed": r.num_routed,
                           "num_in_flight": r.client.num_in_flight, "num_running": stats.num_running,
                           "num_waiting": stats.num_waiting, "prefix_cache_queries": stats.prefix_cache_queries,
                           "prefix_cache_hits": stats.prefix_cache_hits})
        return states

    async def _watch_replicas(self) -> None:
        """A replica whose engine went away is reconnected in the background: when an engine is
        started again at its address it rejoins. A client that reconnects by itself (``reconnect``: the
        launcher restarts engines) is left to do so, and a hung replica rejoins once it beats again."""
        while not self._closed:
            await asyncio.sleep(REJOIN_INTERVAL_S)
            for r in self.replicas:
                if r.client.dead_reason is not None and not r.client.reconnect and r.rejoining is None:
                    r.rejoining = asyncio.create_task(self._rejoin(r))

    async def _rejoin(self, replica: Replica) -> None:
        # The dead client goes first: its socket would reconnect under this frontend's identity, and the
        # engine's ROUTER refuses a second connection with the same one.
        with contextlib.suppress(Exception):
            await replica.client.close()
        try:
            while not self._closed:
                client = self._make_client(replica.address)
                try:
                    ready = await client.start(REJOIN_INTERVAL_S * 5)
                except EngineUnavailable:
                    await client.close()
                    await asyncio.sleep(REJOIN_INTERVAL_S)
                    continue
                if self.ready is not None and ready.max_model_len != self.ready.max_model_len:
                    logger.error("Replica %d came back with max_model_len %d, not %d: left out",
                                 replica.index, ready.max_model_len, self.ready.max_model_len)
                    await client.close()
                    return
                replica.client = client
                logger.warning("Replica %d at %s is back; routing to it again", replica.index, replica.address)
                return
        finally:
            replica.rejoining = None


def sum_stats(results: list[Any]) -> Any:
    """Several replicas' ``stats`` as one engine's (counts summed, KV-cache use averaged)."""
    dicts = [r for r in results if isinstance(r, dict)]
    if not dicts:
        return results[0]
    total: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
            elif k in ("lora_running", "lora_waiting") and isinstance(v, dict):  # by adapter name
                merged = total.setdefault(k, {})
                for name, count in v.items():
                    merged[name] = merged.get(name, 0) + count
    if "kv_usage" in total:
        total["kv_usage"] /= len(dicts)
    if "lora_loaded" in total:  # every replica loads the same adapters
        total["lora_loaded"] = max(d.get("lora_loaded", 0) for d in dicts)
    return total
