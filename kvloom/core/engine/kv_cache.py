"""Paged KV-cache bookkeeping: the block-allocator and prefix-cache interfaces (their plugins live in
kvloom/plugins/builtin) and the manager that gives each request its block table. No tensors here: the
model runner owns the memory."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from kvloom.core.engine.request import Request


class BlockAllocator(Protocol):
    """What a KV-allocator plugin provides: reference-counted blocks ``0..num_blocks-1``
    (kvloom/plugins/builtin/free_list.py is the default).

    ``allocate`` hands out blocks with a reference count of one; ``share`` adds a reference (a
    prefix-cache hit may revive a block that is free but still holds cached KV); ``free`` drops one
    reference per block and a block with none left becomes free again. ``free`` receives a request's
    blocks in the order they should be reused (the allocator may keep its own order).
    ``on_evict`` is called with a block id whenever a free block is handed out again, so a prefix cache
    can forget what the block held; the engine sets it when a prefix cache is enabled.
    """

    num_blocks: int
    on_evict: Callable[[int], None] | None

    def num_free(self) -> int:
        """Blocks with no reference (free, cached or not)."""
        ...

    def ref_count(self, block_id: int) -> int: ...

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, each now with one reference; MemoryError when fewer are free (the manager
        checks ``num_free`` first)."""
        ...

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference to each block; a free block leaves the free pool without being evicted."""
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """One reference fewer to each block; RuntimeError for a block that had none."""
        ...


class PrefixCache(Protocol):
    """What a prefix-caching plugin provides to the KV-cache manager (kvloom/plugins/builtin/prefix_cache.py).
    Only full blocks are cached; the manager owns reference counts, so a cached block in use by one
    request is never freed by another."""

    def lookup(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of ``request.all_token_ids`` (full blocks only, in
        order); the manager shares them with the request."""
        ...

    def cache_blocks(self, request: Request, start_block: int, end_block: int) -> None:
        """Record ``request.block_ids[start_block:end_block]``, which now hold computed KV for full
        blocks of ``request.all_token_ids``."""
        ...

    def evict(self, block_id: int) -> None:
        """The allocator hands this free block out again: forget what it held."""
        ...

    def reset(self) -> bool:
        """Forget every cached block (the manager calls it only when no block is in use)."""
        ...


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
        whole prompt: at least one token must be computed to produce logits. None for a request that
        asks for prompt logprobs: every prompt position's logits are needed."""
        if (self.prefix_cache is None or request.num_computed_tokens > 0
                or request.sampling.prompt_logprobs is not None):
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
        if need <= 0 and not computed_blocks:
            return True  # most running requests, most steps
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

    def cache_blocks(self, request: Request, num_new_tokens: int, end: int | None = None) -> None:
        """Offer the blocks that ``num_new_tokens`` computed tokens ending at ``end`` (default: all the
        computed ones) filled to the prefix cache."""
        if self.prefix_cache is not None:
            end = request.num_computed_tokens if end is None else end
            start_block, end_block = (end - num_new_tokens) // self.block_size, end // self.block_size
            if end_block > start_block:
                self.prefix_cache.cache_blocks(request, start_block, end_block)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (after rejected draft tokens). They
        hold no accepted token, so they were never offered to the prefix cache."""
        keep = self.blocks_for(num_tokens)
        if len(request.block_ids) > keep:
            self.allocator.free(list(reversed(request.block_ids[keep:])))
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        # Later blocks are the least likely to be shared again: free them first so they are reused first.
        self.allocator.free(list(reversed(request.block_ids)))
        request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache. False, with nothing changed, when there is no prefix cache or when
        blocks are in use (requests in flight hold cached blocks: retry when the engine is idle)."""
        if self.prefix_cache is None or self.allocator.num_free() != self.allocator.num_blocks:
            return False
        return self.prefix_cache.reset()
