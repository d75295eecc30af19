"""Paged KV-cache bookkeeping: the block allocator interface, the default free-list allocator, and the
manager that gives each request its block table. No tensors here: the model runner owns the memory."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol, Sequence

from kvloom.core.request import Request


class BlockAllocator(Protocol):
    """What a KV-allocator plugin provides: reference-counted blocks ``0..num_blocks-1``.

    ``allocate`` hands out blocks with a reference count of one; ``share`` adds a reference (a
    prefix-cache hit may revive a block that is free but still holds cached KV); ``free`` drops one
    reference per block and a block with none left becomes free again. ``free`` receives a request's
    blocks in the order they should be reused (the allocator may keep its own order).
    ``on_evict`` is called with a block id whenever a free block is handed out again, so a prefix cache
    can forget what the block held.
    """

    num_blocks: int
    on_evict: Callable[[int], None] | None

    def num_free(self) -> int: ...
    def ref_count(self, block_id: int) -> int: ...
    def allocate(self, n: int) -> list[int]: ...
    def share(self, block_ids: Sequence[int]) -> None: ...
    def free(self, block_ids: Sequence[int]) -> None: ...


class FreeListAllocator:
    """The default allocator: an LRU-ordered free queue (freed blocks go to the back, allocation takes
    from the front), so blocks that held cached prefixes are reused as late as possible."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: Callable[[int], None] | None = None

    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self.ref_counts[block] = 1
            if self.on_evict is not None:
                self.on_evict(block)
            out.append(block)
        return out

    def share(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
            elif self.ref_counts[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")


class PrefixCache(Protocol):
    """What a prefix-caching plugin provides to the KV-cache manager (see plugins/builtin/prefix_cache.py)."""

    def lookup(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (full blocks only);
        the manager shares them with the request."""
        ...

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Record the request's blocks that ``num_computed_tokens`` has filled completely."""
        ...

    def evict(self, block_id: int) -> None: ...
    def reset(self) -> bool: ...


class KVCacheManager:
    """Gives requests their block tables from an allocator, with optional prefix caching."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_cache: PrefixCache | None = None):
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            allocator.on_evict = prefix_cache.evict

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_free_blocks(self) -> int:
        return self.allocator.num_free()

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free() / self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks for a request that has none yet (empty without a prefix cache). Never the
        whole prompt: at least one token must be computed to produce logits."""
        if self.prefix_cache is None or request.num_computed_tokens > 0:
            return []
        blocks = self.prefix_cache.lookup(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return blocks[:max_blocks]

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens (after ``computed_blocks``, if given, which become
        the request's first blocks). False, with nothing changed, when too few blocks are free."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        have = len(request.block_ids) + len(computed_blocks)
        need = self.blocks_for(num_computed + num_new_tokens) - have
        # Shared blocks that are currently free leave the free queue, so count them against it.
        revived = sum(1 for b in computed_blocks if self.allocator.ref_count(b) == 0)
        if need + revived > self.allocator.num_free():
            return False
        if computed_blocks:
            self.allocator.share(computed_blocks)
            request.block_ids.extend(computed_blocks)
        if need > 0:
            request.block_ids.extend(self.allocator.allocate(need))
        return True

    def cache_blocks(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.cache_blocks(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        # Later blocks are the least likely to be shared again: free them first so they are reused first.
        self.allocator.free(list(reversed(request.block_ids)))
        request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        return self.prefix_cache.reset() if self.prefix_cache is not None else False
