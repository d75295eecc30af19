"""Which layers share KV blocks: layers with the same attention window form groups of equal size, each
group with its own block table per request over one pool of blocks (the hybrid KV cache). A block is a
page of ``slots`` layers: layer ``j`` of every group keeps its K/V in the ``j``-th of ``slots`` cache
tensors, so a sliding group that gives a block back frees it for any group. No tensors here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention, every block kept; else the sliding window in tokens
    layers: tuple[int, ...]  # the model's layers; layer layers[j] keeps its K/V in cache tensor j

    def describe(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window}"


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first: group 0 keeps every block when any group does
    num_layers: int

    @property
    def slots(self) -> int:
        """Layers one block spans (the cache tensors): the largest group's size."""
        return max(len(g.layers) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether some group gives blocks back (a sliding window), or there is more than one group."""
        return len(self.groups) > 1 or self.groups[0].window is not None

    def group_of_layer(self) -> list[int]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def slot_of_layer(self) -> list[int]:
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        return out

    def window_blocks(self, window: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks a sliding group holds while ``new_tokens`` tokens are computed: the blocks the first new
        token's window reaches into, and the new tokens'."""
        return -(-(window - 1) // block_size) + 1 + -(-(new_tokens - 1) // block_size)

    def sequence_blocks(self, num_tokens: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks of the pool one sequence of ``num_tokens`` holds (all groups) while computing ``new_tokens``
        of them: a full group one per ``block_size`` tokens, a sliding group at most its window's."""
        blocks = -(-num_tokens // block_size)
        return sum(blocks if g.window is None else min(blocks, self.window_blocks(g.window, block_size, new_tokens))
                   for g in self.groups)

    def longest_sequence(self, num_blocks: int, block_size: int) -> int | None:
        """The most tokens one sequence can hold in ``num_blocks`` blocks (whole blocks), None when no
        group keeps every block (every layer slides: any length fits once the windows fit)."""
        full = sum(1 for g in self.groups if g.window is None)
        if full == 0:
            return None
        lo, hi = 0, num_blocks // full + 1  # blocks per sequence: need(lo) <= num_blocks < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.sequence_blocks(mid * block_size, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid
        return lo * block_size

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.describe()] = counts.get(g.describe(), 0) + 1
        return ", ".join(f"{n} {what}" for what, n in counts.items())


def kv_layout(windows: list[int | None], hybrid: bool = True) -> KVLayout:
    """The groups of a model whose layer ``i`` attends over ``windows[i]`` tokens (None: all of them). Each
    window's layers are cut into groups of the smallest window's layer count (Gemma 3: five groups of
    sliding layers and one of global ones, each as large as the global layers). Without ``hybrid`` (or
    without windows) every layer is in one full-attention group: every block is kept."""
    num_layers = len(windows)
    if not hybrid or all(w is None for w in windows):
        return KVLayout((KVGroup(None, tuple(range(num_layers))),), num_layers)
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    size = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):  # full attention first
        layers = by_window[window]
        groups += [KVGroup(window, tuple(layers[i: i + size])) for i in range(0, len(layers), size)]
    return KVLayout(tuple(groups), num_layers)


def model_kv_layout(hf_config, hybrid: bool = True) -> KVLayout:
    """``kv_layout`` of a model from its config, through its family's per-layer attention specs."""
    from kvloom.core.model.families import model_class

    cls = model_class(hf_config)
    windows = [cls.attention_spec(hf_config, i).sliding_window for i in range(hf_config.num_hidden_layers)]
    return kv_layout(windows, hybrid)
