"""Prefix-cache plugin ``prefix_cache``: automatic prefix caching over full KV blocks.

Each full block is named by a chained hash of (parent block's hash, the block's tokens, extra keys), so
one hash stands for the whole prefix up to that block. A lookup walks a new request's full blocks from
the first and stops at the first miss. A hash is never trusted alone: every hit is checked against the
parent hash and tokens stored with the block, so a collision costs a cache miss, never a wrong token.
Freed blocks keep their hash in the allocator's free queue (reused last) until they are handed out again.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import msgspec

from kvloom.core.engine.request import Request
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo, PluginOption

BlockHasher = Callable[[Hashable, Sequence[int], tuple], Hashable]


def sha256_block_hash(parent: bytes, tokens: Sequence[int], extra_keys: tuple) -> bytes:
    """SHA-256 over the parent digest, the tokens as little-endian int64 and the msgpack of the extra
    keys: the same in every process and on every machine, so caches could be shared or routed to."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra_keys:
        h.update(msgspec.msgpack.encode(extra_keys))
    return h.digest()


def builtin_block_hash(parent: int, tokens: Sequence[int], extra_keys: tuple) -> int:
    """Python's hash of a tuple: faster, 64 bits, and meaningful only inside this process (its root is
    a random per-process seed, so clients cannot aim for collisions; those would only cost misses)."""
    return hash((parent, tuple(tokens), extra_keys))


HASHERS: dict[str, tuple[BlockHasher, Callable[[], Hashable]]] = {
    "sha256": (sha256_block_hash, lambda: bytes(32)),
    "builtin": (builtin_block_hash, lambda: secrets.randbits(63)),
}


@dataclass(frozen=True)
class CachedBlock:
    block_hash: Hashable  # the key: the chained hash, with its layer group's index in a hybrid cache
    parent_hash: Hashable
    tokens: tuple[int, ...]


class HashPrefixCache:
    """The table from chained block hash to KV block, with what each cached block holds."""

    def __init__(self, block_size: int, hash_algorithm: str = "sha256") -> None:
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self._hash, make_root = HASHERS[hash_algorithm]
        self.root_hash = make_root()
        self._by_hash: dict[Hashable, int] = {}
        self._blocks: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def extra_keys(self, request: Request) -> tuple:
        """What besides tokens decides a block's KV: the LoRA adapter's digest, so blocks computed under one
        adapter match only requests of that same adapter (never the base model's, never another's).
        Multimodal inputs or a per-tenant cache salt would go here too."""
        return (request.lora_key,) if request.lora_key else ()

    def block_hashes(self, request: Request) -> list[Hashable]:
        """Chained hashes of the request's full blocks, extended as tokens arrive. Kept on the request:
        tokens are only ever appended, so the hashes stay valid across steps and preemptions."""
        hashes = request.block_hashes
        tokens, bs = request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else self.root_hash
        extra = self.extra_keys(request)
        for i in range(len(hashes), len(tokens) // bs):
            parent = self._hash(parent, tokens[i * bs : (i + 1) * bs], extra)
            hashes.append(parent)
        return hashes

    def lookup(self, request: Request) -> list[int]:
        found: list[int] = []
        parent = self.root_hash
        tokens, bs = request.all_token_ids, self.block_size
        for i, block_hash in enumerate(self.block_hashes(request)):
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            cached = self._blocks[block]
            if cached.parent_hash != parent or cached.tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                break  # a hash collision: the stored tokens decide
            found.append(block)
            parent = block_hash
        return found

    def cache_blocks(self, request: Request, start_block: int, end_block: int, group: int = 0) -> None:
        hashes = self.block_hashes(request)
        tokens, bs = request.all_token_ids, self.block_size
        table = request.block_ids if group == 0 else request.extra_block_ids[group - 1]
        for i in range(start_block, end_block):
            block, block_hash = table[i], hashes[i]
            key = block_hash if group == 0 else (group, block_hash)  # a hybrid cache's groups apart
            if key in self._by_hash or block in self._blocks:
                continue  # the same prefix was computed twice at once: the first copy stays cached
            parent = hashes[i - 1] if i else self.root_hash
            self._by_hash[key] = block
            self._blocks[block] = CachedBlock(key, parent, tuple(tokens[i * bs : (i + 1) * bs]))

    def cached_block(self, request: Request, group: int, index: int) -> int | None:
        hashes = self.block_hashes(request)
        if index >= len(hashes):
            return None
        block = self._by_hash.get(hashes[index] if group == 0 else (group, hashes[index]))
        if block is None:
            return None
        cached, bs = self._blocks[block], self.block_size
        parent = hashes[index - 1] if index else self.root_hash
        if cached.parent_hash != parent or cached.tokens != tuple(request.all_token_ids[index * bs: (index + 1) * bs]):
            return None  # a hash collision: the stored tokens decide
        return block

    def evict(self, block_id: int) -> None:
        cached = self._blocks.pop(block_id, None)
        if cached is not None:
            del self._by_hash[cached.block_hash]

    def reset(self) -> bool:
        self._by_hash.clear()
        self._blocks.clear()
        return True


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(
        kind="prefix_cache",
        description="Automatic prefix caching over full KV blocks (chained block hashes verified against "
                    "stored tokens; freed cached blocks are reused last).",
        options=(PluginOption("hash_algorithm", "sha256", "Block hash: sha256 (stable across processes) or "
                              "builtin (Python's hash, faster, this process only).", choices=tuple(HASHERS)),),
    )


@hookimpl
def kvloom_prefix_cache(block_size: int, options: dict[str, Any]) -> HashPrefixCache:
    return HashPrefixCache(block_size, **options)
