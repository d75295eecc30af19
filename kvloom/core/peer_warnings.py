"""Warnings about what a socket peer sent, rate-limited per peer: a peer that sends junk in a loop
must not turn the log into the bottleneck (or fill the disk)."""

from __future__ import annotations

import logging
import time


class PeerWarnings:
    """At most ``burst`` warnings per peer in each ``window_s``; the ones held back are counted and the
    next warning let through says how many. At most ``max_peers`` peers are tracked: past that every
    other peer shares one budget, so many strangers cannot multiply it."""

    def __init__(self, logger: logging.Logger, burst: int = 5, window_s: float = 60.0, max_peers: int = 1000,
                 clock=time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self.max_peers = max_peers
        self.clock = clock
        self._peers: dict[bytes, list] = {}  # peer -> [window start, warnings in it, held back since last]
        self._pruned = float("-inf")

    def warning(self, peer: bytes, message: str, *args) -> bool:
        """Log ``message % args`` unless ``peer`` spent its budget; True when it was logged."""
        now = self.clock()
        if peer not in self._peers and len(self._peers) >= self.max_peers and now - self._pruned >= self.window_s:
            self._pruned = now  # at most once a window: peers quiet for a whole window make room
            self._peers = {p: s for p, s in self._peers.items() if now - s[0] < self.window_s or s[2]}
        key = peer if peer in self._peers or len(self._peers) < self.max_peers else b"<other peers>"
        state = self._peers.setdefault(key, [now, 0, 0])
        if now - state[0] >= self.window_s:
            state[0], state[1] = now, 0
        if state[1] >= self.burst:
            state[2] += 1
            return False
        state[1] += 1
        held, state[2] = state[2], 0
        if held:
            message += f" ({held} similar warning(s) about this peer were held back)"
        self.logger.warning(message, *args)
        return True

    def forget(self, peer: bytes) -> None:
        self._peers.pop(peer, None)
