"""The /v1/responses store on its own: count, byte and age caps drop the oldest entries first; an entry
belongs to its API key; an SQLite file is shared by every process that opens it (the API workers)."""

from __future__ import annotations

import asyncio

import pytest

from kvloom.frontends.responses_store import MemoryResponseStore, SqliteResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(size: int = 10) -> StoredResponse:
    return StoredResponse(b"r" * (size // 2), b"c" * (size - size // 2))


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path):
    stores = []

    def make(max_entries=100, max_bytes=10_000, max_age=60.0, clock=None, path=None):
        clock = clock or Clock()
        if request.param == "memory":
            store = MemoryResponseStore(max_entries, max_bytes, max_age, clock)
        else:
            store = SqliteResponseStore(str(path or tmp_path / "responses.sqlite"), max_entries, max_bytes, max_age,
                                        clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        if isinstance(store, SqliteResponseStore):
            store.close()


def run(coro):
    return asyncio.run(coro)


def test_count_cap_drops_the_oldest(make):
    clock = Clock()
    store = make(max_entries=3, clock=clock)
    for i in range(5):
        clock.now += 1
        run(store.put(f"r{i}", "k", entry()))
    assert [run(store.get(f"r{i}", "k")) is not None for i in range(5)] == [False, False, True, True, True]
    assert len(store) == 3


def test_byte_cap_drops_the_oldest(make):
    clock = Clock()
    store = make(max_bytes=250, clock=clock)
    for i in range(4):
        clock.now += 1
        run(store.put(f"r{i}", "k", entry(100)))
    assert [run(store.get(f"r{i}", "k")) is not None for i in range(4)] == [False, False, True, True]


def test_age_cap(make):
    clock = Clock()
    store = make(max_age=60.0, clock=clock)
    run(store.put("old", "k", entry()))
    clock.now += 30
    run(store.put("new", "k", entry()))
    clock.now += 31  # "old" is 61 s old, "new" 31 s
    assert run(store.get("old", "k")) is None and run(store.get("new", "k")) == entry()


def test_entries_belong_to_their_key(make):
    store = make()
    run(store.put("r", "alice", entry()))
    assert run(store.get("r", "bob")) is None and not run(store.delete("r", "bob"))
    assert run(store.get("r", "alice")) == entry()
    assert run(store.delete("r", "alice")) and run(store.get("r", "alice")) is None


def test_sqlite_file_is_shared_between_workers(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    a, b = (SqliteResponseStore(path, 100, 10_000, 60.0) for _ in range(2))
    try:
        run(a.put("from-a", "k", entry()))
        assert run(b.get("from-a", "k")) == entry()
        assert run(b.delete("from-a", "k")) and run(a.get("from-a", "k")) is None
    finally:
        a.close()
        b.close()
