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

    def cache_blocks(self, request: Request, start_block: int, end_block: int, group: int = 0) -> None:
        """Record ``request.block_ids[start_block:end_block]``, which now hold computed KV for full
        blocks of ``request.all_token_ids``. In a hybrid cache, ``group`` names the layer group whose
        table (``request.extra_block_ids[group - 1]`` beyond the first) the blocks are from: each group's
        blocks are cached under their own keys."""
        ...

    def cached_block(self, request: Request, group: int, index: int) -> int | None:
        """Group ``group``'s cached block holding full block ``index`` of the request's tokens (its prefix
        included, as the chained hash says), or None. A hybrid cache's hit is checked block by block: a
        sliding group needs only the blocks its window reads."""
        ...

    def evict(self, block_id: int) -> None:
        """The allocator hands this free block out again: forget what it held."""
        ...

    def reset(self) -> bool:
        """Forget every cached block (the manager calls it only when no block is in use)."""
        ...


class CachedPrefix(list):
    """A prefix-cache hit of a hybrid cache: the first group's blocks (its length is the hit in blocks), with
    every group's table (``tables``) and how many leading entries of each are placeholders (``skipped``):
    blocks before a sliding group's window, which it never holds."""

    def __init__(self, tables: list[list[int]], skipped: list[int]) -> None:
        super().__init__(tables[0])
        self.tables, self.skipped = tables, skipped

    def live(self) -> list[int]:
        return [b for t, k in zip(self.tables, self.skipped) for b in t[k:]]


class KVCacheManager:
    """Gives requests their block tables from an allocator, with optional prefix caching. With a hybrid
    ``layout`` (``kv_layout.KVLayout``) each layer group has its own table per request (the first in
    ``request.block_ids``, the others in ``request.extra_block_ids``), all drawn from the one pool, and a
    sliding group gives back the blocks its window can no longer read before each step (the table keeps
    their ids, never read again; ``request.num_skipped_blocks`` counts them per group)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_cache: PrefixCache | None = None,
                 layout=None):
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            allocator.on_evict = prefix_cache.evict
        self.layout = layout if layout is not None and layout.hybrid else None
        self.windows = [g.window for g in self.layout.groups] if self.layout is not None else [None]
        # Blocks given back while requests ran (sliding layers), for stats and tests.
        self.num_window_freed = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_free_blocks(self) -> int:
        return self.allocator.num_free()

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free() / self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequence_blocks(self, num_tokens: int, new_tokens: int = 1) -> int:
        """Blocks of the pool a sequence of ``num_tokens`` holds while computing ``new_tokens`` of them."""
        if self.layout is None:
            return self.blocks_for(num_tokens)
        return self.layout.sequence_blocks(num_tokens, self.block_size, new_tokens)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks for a request that has none yet (empty without a prefix cache). Never the
        whole prompt: at least one token must be computed to produce logits. None for a request that
        asks for prompt logprobs or pools more than the last position: every prompt position is needed."""
        if (self.prefix_cache is None or request.num_computed_tokens > 0
                or request.sampling.prompt_logprobs is not None
                or (request.pooling is not None and request.pooling.type != "last")):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.layout is not None:
            return self._hybrid_hit(request, max_blocks)
        blocks = self.prefix_cache.lookup(request)
        return blocks[:max_blocks]

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block group ``group`` reads when the tokens from ``num_computed`` on are computed."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _hybrid_hit(self, request: Request, max_blocks: int) -> list[int]:
        """The longest prefix every group holds: full groups all of its blocks, sliding groups the blocks
        the first uncached token's window reads."""
        cache, hit = self.prefix_cache, max_blocks
        for g, window in enumerate(self.windows):
            if window is None:
                hit = min(hit, len(cache.lookup(request)) if g == 0 else self._chain(request, g, hit))
        while hit > 0:
            tables, skipped = [], []
            for g in range(len(self.windows)):
                first = self._first_needed(g, hit * self.block_size)
                blocks = [cache.cached_block(request, g, i) for i in range(first, hit)]
                if any(b is None for b in blocks):
                    break
                tables.append([0] * first + blocks)
                skipped.append(first)
            else:
                return CachedPrefix(tables, skipped)
            hit -= 1
        return []

    def _chain(self, request: Request, group: int, limit: int) -> int:
        n = 0
        while n < limit and self.prefix_cache.cached_block(request, group, n) is not None:
            n += 1
        return n

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block table of each layer group."""
        if self.layout is not None and not request.num_skipped_blocks:
            request.extra_block_ids = [[] for _ in self.windows[1:]]
            request.num_skipped_blocks = [0] * len(self.windows)
        return [request.block_ids, *request.extra_block_ids]

    def _release_outside_windows(self, request: Request) -> None:
        """Give back the blocks no sliding window can read again: those wholly before the window of the
        next token to compute (spec decoding's rejected drafts never roll back past it)."""
        skipped = request.num_skipped_blocks
        for g, table in enumerate(self.tables(request)):
            first = min(self._first_needed(g, request.num_computed_tokens), len(table))
            if first > skipped[g]:
                self.allocator.free(list(reversed(table[skipped[g]: first])))
                self.num_window_freed += first - skipped[g]
                skipped[g] = first

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens (after ``computed_blocks``, if given, which become
        the request's first blocks). False, with nothing changed, when too few blocks are free (in a
        hybrid cache the blocks outside the windows are given back first: the request never reads them
        again, whether it runs this step or not)."""
        if self.layout is not None:
            return self._allocate_hybrid(request, num_new_tokens, computed_blocks)
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

    def _allocate_hybrid(self, request: Request, num_new_tokens: int, computed: Sequence[int]) -> bool:
        tables = self.tables(request)
        if not computed:
            self._release_outside_windows(request)
        hit = len(computed) if isinstance(computed, CachedPrefix) else 0
        end_blocks = self.blocks_for(request.num_computed_tokens + hit * self.block_size + num_new_tokens)
        have = hit if hit else len(tables[0])
        need = (end_blocks - have) * len(tables)
        if need <= 0 and not hit:
            return True
        live = computed.live() if hit else []
        revived = sum(1 for b in live if self.allocator.ref_count(b) == 0)
        if max(need, 0) + revived > self.allocator.num_free():
            return False
        if hit:
            self.allocator.share(live)
            for table, cached in zip(tables, computed.tables):
                table.extend(cached)
            request.num_skipped_blocks = list(computed.skipped)
        if need > 0:
            new = self.allocator.allocate(need)
            per = need // len(tables)
            for g, table in enumerate(tables):
                table.extend(new[g * per: (g + 1) * per])
        return True

    def cache_blocks(self, request: Request, num_new_tokens: int, end: int | None = None) -> None:
        """Offer the blocks that ``num_new_tokens`` computed tokens ending at ``end`` (default: all the
        computed ones) filled to the prefix cache (each group's that it still holds)."""
        if self.prefix_cache is not None:
            end = request.num_computed_tokens if end is None else end
            start_block, end_block = (end - num_new_tokens) // self.block_size, end // self.block_size
            if self.layout is None:
                if end_block > start_block:
                    self.prefix_cache.cache_blocks(request, start_block, end_block)
                return
            for g in range(len(self.tables(request))):
                start = max(start_block, request.num_skipped_blocks[g])
                if end_block > start:
                    self.prefix_cache.cache_blocks(request, start, end_block, group=g)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (after rejected draft tokens). They
        hold no accepted token, so they were never offered to the prefix cache."""
        keep = self.blocks_for(num_tokens)
        for g, table in enumerate(self.tables(request)):
            if len(table) > keep:
                start = keep if self.layout is None else max(keep, request.num_skipped_blocks[g])
                self.allocator.free(list(reversed(table[start:])))
                del table[keep:]

    def free(self, request: Request) -> None:
        # Later blocks are the least likely to be shared again: free them first so they are reused first.
        if self.layout is None:
            self.allocator.free(list(reversed(request.block_ids)))
            request.block_ids = []
            return
        for g, table in enumerate(self.tables(request)):
            self.allocator.free(list(reversed(table[request.num_skipped_blocks[g]:])))
        request.block_ids, request.extra_block_ids, request.num_skipped_blocks = [], [], []

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache. False, with nothing changed, when there is no prefix cache or when
        blocks are in use (requests in flight hold cached blocks: retry when the engine is idle)."""
        if self.prefix_cache is None or self.allocator.num_free() != self.allocator.num_blocks:
            return False
        return self.prefix_cache.reset()
