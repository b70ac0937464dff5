"""The waiting requests, in the order they should be admitted: fair across tenants, by priority within one.

Each tenant has a virtual time: the tokens the engine computed for it (prompt pieces, decoded tokens, drafts),
divided by its weight. The next request comes from the tenant whose virtual time is least, so a tenant that
sends 200 requests at once is served as much as one that sends one, no more (start-time fair queuing over
tokens). A tenant that had nothing waiting starts again no lower than the virtual time of the last admission:
time spent idle is not saved up to be spent in a burst later.

Within a tenant, a lower `priority` comes first (vLLM's convention), then arrival order. A priority orders a
tenant's own requests only: it never moves them ahead of another tenant's, or any tenant could claim the whole
engine with it. With fairness off, one queue holds every tenant's requests (priority, then arrival order).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from service.core.request import Request


@dataclass
class _Tenant:
    weight: float = 1.0
    vtime: float = 0.0  # tokens computed for the tenant / its weight (plus the idle catch-up)
    queue: list[tuple[int, int, Request]] = field(default_factory=list)  # sorted by (priority, arrival)


class FairQueue:
    """Waiting requests. Iterating gives them in admission order, each choice made with the charges made so
    far, so a scheduler that admits one and charges it before asking for the next sees the next fair choice."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._tenants: dict[str, _Tenant] = {}
        self._arrivals = itertools.count()
        self._order: dict[int, tuple[int, int]] = {}  # request id -> its sort key, kept when preempted
        self._clock = 0.0  # the virtual time of the last admission
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def add(self, request: Request) -> None:
        """Queue a request: a new one behind its tenant's requests of the same priority, a preempted one
        back where it was."""
        tenant = self._tenants.setdefault(self._key(request), _Tenant(request.tenant_weight))
        if request.id not in self._order:  # a new request's: a reloaded weight applies from now on (not a
            tenant.weight = request.tenant_weight  # preempted request's, which came with the weight before)
        if not tenant.queue:
            tenant.vtime = max(tenant.vtime, self._clock)
        key = self._order.setdefault(request.id, (request.priority, next(self._arrivals)))
        bisect.insort(tenant.queue, (*key, request), key=lambda item: item[:2])
        self._len += 1

    def remove(self, request: Request) -> None:
        """Take a request out (admitted, finished or expired while waiting)."""
        tenant = self._tenants[self._key(request)]
        index = next(i for i, (*_, r) in enumerate(tenant.queue) if r is request)
        del tenant.queue[index]
        self._len -= 1

    def forget(self, request: Request) -> None:
        """The request is finished: its place in line is no longer kept."""
        self._order.pop(request.id, None)

    def admitted(self, request: Request) -> None:
        """Take out a request the scheduler admits; the virtual clock moves to its tenant's time."""
        self.remove(request)
        self._clock = max(self._clock, self._tenants[self._key(request)].vtime)

    def charge(self, request: Request, num_tokens: int) -> None:
        """The engine computes num_tokens for this request's tenant."""
        tenant = self._tenants.setdefault(self._key(request), _Tenant(request.tenant_weight))
        tenant.vtime += num_tokens / tenant.weight

    def tenants(self) -> dict[str, float]:
        """The tenants with requests waiting, and their weights."""
        return {name: t.weight for name, t in self._tenants.items() if t.queue}

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in admission order. The tenant of each next one is chosen when it is asked
        for: the least virtual time (ties: the earlier arrival), among tenants with requests not yet given."""
        queues = {name: list(t.queue) for name, t in self._tenants.items() if t.queue}
        positions = dict.fromkeys(queues, 0)
        while queues:
            name = min(queues, key=lambda n: (self._tenants[n].vtime, queues[n][positions[n]][1]))
            yield queues[name][positions[name]][2]
            positions[name] += 1
            if positions[name] == len(queues[name]):
                del queues[name]

    def _key(self, request: Request) -> str:
        return request.tenant if self.fair else ""
