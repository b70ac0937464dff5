"""The process's serving state, decided in one place for both fronts: loading (no engine) -> serving ->
leaving (not ready, so that load balancers stop sending work, but still accepting it) -> draining (refusing new
requests), or stopped once the engine thread died. gRPC health and HTTP /ready both read `ready`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from service.engine import EngineClient
from service.errors import Unavailable

log = logging.getLogger(__name__)


class Serving:
    def __init__(self) -> None:
        self.engine: EngineClient | None = None
        self.leaving = False  # not ready any more, still accepting: the load balancers are catching up
        self.draining = False
        self.num_in_flight = 0  # generation requests being answered, both fronts (drain waits for them)
        self._listeners: list[Callable[[bool], None]] = []

    def require_engine(self) -> EngineClient:
        """The engine, or Unavailable saying why there is none to serve a request."""
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.engine is None:
            raise Unavailable("the model is still loading; retry shortly")
        if not self.engine.alive:
            raise Unavailable("the engine has stopped; retry on another replica")
        return self.engine

    @property
    def ready(self) -> bool:
        return self.unready() is None

    def unready(self) -> Unavailable | None:
        """Why this replica should get no new work (health NOT_SERVING, /ready 503), or None when ready. While
        leaving it still serves what reaches it (require_engine), but says it is not ready."""
        if self.leaving and not self.draining:
            return Unavailable("the server is shutting down; it still serves requests that reach it for a moment")
        try:
            self.require_engine()
        except Unavailable as exc:
            return exc
        return None

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call listener(ready) on the event loop whenever readiness may have changed (pushed health watches)."""
        self._listeners.append(listener)

    def attach(self, engine: EngineClient) -> None:
        """The engine is started and serves from now on."""
        self.engine = engine
        self.changed()

    def leave(self) -> None:
        """Not ready from now on (health checks fail), while new requests are still served."""
        self.leaving = True
        self.changed()

    def drain(self) -> None:
        """Refuse new requests from now on."""
        self.leaving = self.draining = True
        self.changed()

    def changed(self) -> None:
        ready = self.ready
        for listener in self._listeners:
            listener(ready)
