"""Stored /v1/responses responses (``store``, ``previous_response_id``, GET and DELETE): in memory, or in
an SQLite file that every API worker shares; bounded by count, bytes and age, the oldest dropped first.
Each entry belongs to the API key that made it: another key never sees it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass
class StoredResponse:
    response: bytes  # the response object, as GET returns it (JSON)
    conversation: bytes  # the chat it ended, its output included (JSON), for previous_response_id


class MemoryResponseStore:
    """One API worker's store; the launcher gives several workers a shared SQLite file instead."""

    def __init__(self, max_entries: int, max_bytes: int, max_age: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_entries, self.max_bytes, self.max_age = max_entries, max_bytes, max_age
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, str, StoredResponse]] = OrderedDict()  # oldest first
        self._bytes = 0

    async def put(self, rid: str, owner: str, entry: StoredResponse) -> None:
        self._drop(rid)
        self._entries[rid] = (self.clock(), owner, entry)
        self._bytes += _size(entry)
        self._evict()

    async def get(self, rid: str, owner: str) -> StoredResponse | None:
        self._evict()
        found = self._entries.get(rid)
        return found[2] if found is not None and found[1] == owner else None

    async def delete(self, rid: str, owner: str) -> bool:
        found = self._entries.get(rid)
        if found is None or found[1] != owner:
            return False
        self._drop(rid)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, rid: str) -> None:
        old = self._entries.pop(rid, None)
        if old is not None:
            self._bytes -= _size(old[2])

    def _evict(self) -> None:
        oldest = self.clock() - self.max_age
        while self._entries:
            rid, (created, _, _) = next(iter(self._entries.items()))
            if created >= oldest and len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                break
            self._drop(rid)


def _size(entry: StoredResponse) -> int:
    return len(entry.response) + len(entry.conversation)


class SqliteResponseStore:
    """The store in an SQLite file (write-ahead log, so API workers read while one writes); each call
    runs on a worker thread, never on the event loop."""

    def __init__(self, path: str, max_entries: int, max_bytes: int, max_age: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_entries, self.max_bytes, self.max_age = max_entries, max_bytes, max_age
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL NOT NULL, "
                             "owner TEXT NOT NULL, size INTEGER NOT NULL, response BLOB NOT NULL, "
                             "conversation BLOB NOT NULL)")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")

    async def put(self, rid: str, owner: str, entry: StoredResponse) -> None:
        await asyncio.to_thread(self._put, rid, owner, entry)

    async def get(self, rid: str, owner: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, rid, owner)

    async def delete(self, rid: str, owner: str) -> bool:
        return await asyncio.to_thread(self._delete, rid, owner)

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def _put(self, rid: str, owner: str, entry: StoredResponse) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                                 (rid, self.clock(), owner, _size(entry), entry.response, entry.conversation))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self) -> None:
        db = self._db
        db.execute("DELETE FROM responses WHERE created < ?", (self.clock() - self.max_age,))
        db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC "
                   "LIMIT -1 OFFSET ?)", (self.max_entries,))
        total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        while total > self.max_bytes:
            rid, size = db.execute("SELECT id, size FROM responses ORDER BY created LIMIT 1").fetchone()
            db.execute("DELETE FROM responses WHERE id = ?", (rid,))
            total -= size

    def _get(self, rid: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT response, conversation FROM responses WHERE id = ? AND owner = ? "
                                   "AND created >= ?", (rid, owner, self.clock() - self.max_age)).fetchone()
        return StoredResponse(bytes(row[0]), bytes(row[1])) if row is not None else None

    def _delete(self, rid: str, owner: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (rid, owner)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_response_store(path: str | None, max_entries: int, max_mb: float,
                        max_age: float) -> MemoryResponseStore | SqliteResponseStore:
    max_bytes = int(max_mb * 2**20)
    if path is None:
        return MemoryResponseStore(max_entries, max_bytes, max_age)
    return SqliteResponseStore(path, max_entries, max_bytes, max_age)
