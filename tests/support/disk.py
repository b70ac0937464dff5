"""Driving the disk tier without an engine: the reports its loads send, and waiting for its writes."""

import threading
import time

from service.engine.disk_store import DiskStore
from service.engine.kv_tier import LoadResult


class Reports:
    """Stands in for the engine's command queue: keeps the load results the tier reports."""

    def __init__(self) -> None:
        self.results: list[LoadResult] = []
        self.event = threading.Event()

    def __call__(self, result: LoadResult) -> None:
        self.results.append(result)
        self.event.set()

    def wait(self) -> LoadResult:
        assert self.event.wait(10), "the load was never reported"
        self.event.clear()
        return self.results[-1]


def wait_written(store: DiskStore, n: int) -> None:
    deadline = time.monotonic() + 10
    while store.counters.num_written < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.counters.num_written == n
