"""The composition root: one process owns the metrics, the serving state, the engine's life (load, death,
drain order) and both fronts. Only this module imports both fronts; the fronts import neither each other nor
this module.

Answers at once (health NOT_SERVING, generation UNAVAILABLE) while the model loads and warms up, then SERVING.
On SIGTERM or SIGINT: NOT_SERVING, new requests UNAVAILABLE (HTTP 503), in-flight requests get
--drain-grace-seconds to finish, then exit 0. If the engine thread dies: NOT_SERVING at once, every request
UNAVAILABLE, exit 1 (so that a supervisor such as Kubernetes restarts the process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from service.config import ServerConfig, env_name
from service.engine import Engine, EngineClient, FolderInUse, UnreadableModel
from service.engine.model_files import ModelFiles
from service.http.front import HttpFront
from service.metrics import Metrics
from service.rpc.front import GrpcFront
from service.serving.auth import Auth
from service.serving.state import Serving

log = logging.getLogger("service.process")

KEYS_POLL_SECONDS = 2.0  # how often the keys file's inode, size and modification time are compared


class Server:
    """Both fronts around one engine. Construction binds every port (a taken port fails here); start() answers
    at once; attach() or load() make it serve; drain() takes it down gracefully."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine_failed = asyncio.Event()  # set when the engine thread died: the process must exit non-zero
        self.hurrying = asyncio.Event()  # set by a second signal: the drain stops waiting
        self.metrics = Metrics()
        self.serving = Serving()
        self.auth = Auth.from_files(config.auth_token_file, config.api_keys_file, config.share_cache_across_tenants)
        self.keys_watch: asyncio.Task[None] | None = None
        self.keys_reload = asyncio.Lock()
        with port_named(config.host, config.port, "port"):
            self.grpc = GrpcFront(config, self.serving, self.metrics, self.auth)
        self.port = self.grpc.port
        self.http = None
        if config.http_port:
            with port_named(config.host, config.http_port, "http_port"):
                self.http = HttpFront(config, self.serving, self.metrics, self.auth)

    @property
    def engine(self) -> EngineClient | None:
        return self.serving.engine

    async def start(self) -> None:
        if self.auth.path is not None:
            self.keys_watch = asyncio.get_running_loop().create_task(self.watch_keys())
        await self.grpc.start()
        if self.config.metrics_port:
            with port_named(self.config.host, self.config.metrics_port, "metrics_port"):
                self.metrics.serve(self.config.metrics_port, self.config.host)
        log.info("listening on %s:%d%s", self.config.host, self.port, " (TLS)" if self.config.tls_cert else "")
        if self.http is not None:
            await self.http.start()

    async def attach(self, engine: EngineClient, started: bool = False) -> None:
        """Start (warm up) the engine off the event loop unless it already is, then serve."""
        loop = asyncio.get_running_loop()

        def died() -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._engine_died)

        engine.on_death(died)
        if not started:
            await asyncio.to_thread(engine.start)
        self.metrics.attach(engine)
        if not engine.alive:
            raise RuntimeError("the engine stopped while starting")
        self.serving.attach(engine)
        if self.http is not None:
            log.info("%s", sampling_note(engine.info.sampling_defaults, engine.info.model_dir))
        log.info("serving %s", self.ready_line(engine))

    def ready_line(self, engine: EngineClient) -> str:
        """The model, where to reach it, and the versions: the last line of a start."""
        info, config = engine.info, self.config
        places = [f"gRPC {config.host}:{self.port}"]
        if self.http is not None:
            places += [f"OpenAI API {self.http.url}v1", f"playground {self.http.url}"]
        if config.metrics_port:
            places.append(f"metrics http://{config.host}:{config.metrics_port}/metrics")
        elif self.http is not None:
            places.append(f"metrics {self.http.url}metrics")
        return (
            f"{info.model_id} (context {info.max_model_len} tokens, {info.num_threads} threads, "
            f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens) at {', '.join(places)}; {versions()}"
        )

    def _engine_died(self) -> None:
        """On the loop: tell health watchers (readiness already reads the dead engine) and run() to exit."""
        log.critical("the engine stopped; reporting NOT_SERVING")
        self.engine_failed.set()
        self.serving.changed()

    async def watch_keys(self) -> None:
        """Read the keys file again whenever it changes (polled every KEYS_POLL_SECONDS)."""
        while True:
            await asyncio.sleep(KEYS_POLL_SECONDS)
            await self.reload_keys()

    async def reload_keys(self, force: bool = False) -> None:
        """One reload at a time: SIGHUPs while one runs wait here, not in threads of the pool requests use."""
        async with self.keys_reload:
            await asyncio.to_thread(self.auth.reload, force)

    async def load(self) -> None:
        """Load the model named by the config (blocking work in a thread), then attach it."""
        engine = await asyncio.to_thread(Engine, self.config.model, self.config.engine)
        await self.attach(engine)

    async def drain(self, grace_seconds: float | None = None, delay_seconds: float | None = None) -> None:
        """Report NOT_SERVING at once but keep serving new requests for the delay (the load balancers stop
        sending them meanwhile), then refuse new requests (UNAVAILABLE), let in-flight requests of both fronts
        finish within the grace period, then stop the fronts and the engine. Defaults: the configured delay and
        grace; hurry() cuts either short."""
        serving = self.serving
        delay = self.config.drain_delay_seconds if delay_seconds is None else delay_seconds
        if delay > 0 and serving.ready:
            serving.leave()
            log.info("not ready; still serving new requests for %.3g s while load balancers catch up", delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hurrying.wait(), delay)
        serving.drain()  # health watchers hear NOT_SERVING through the serving state's listeners
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        deadline = time.monotonic() + grace
        while serving.num_in_flight and time.monotonic() < deadline and not self.hurrying.is_set():
            await asyncio.sleep(0.05)
        if serving.num_in_flight:
            log.warning("drain over; cancelling %d requests", serving.num_in_flight)
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace=0 if self.hurrying.is_set() else 1.0)
        self.metrics.stop()
        if self.keys_watch is not None:
            self.keys_watch.cancel()
        if serving.engine is not None:
            await asyncio.to_thread(serving.engine.shutdown)
        log.info("stopped")

    def hurry(self) -> None:
        """Cut the drain's delay and grace short (a second signal)."""
        self.hurrying.set()


async def start_server(engine: EngineClient, config: ServerConfig, started: bool = False) -> tuple[Server, int]:
    """An in-process server around an engine, serving when this returns. Use port=0 for a free port."""
    server = Server(config)
    await server.start()
    await server.attach(engine, started)
    return server, server.port


def sampling_note(defaults: tuple[tuple[str, float], ...], model_dir: str) -> str:
    """What an HTTP request that sets no sampling field gets, and where that comes from (gRPC is greedy)."""
    source = Path(model_dir) / "generation_config.json"
    if defaults:
        chosen = ", ".join(f"{name} {value:g}" for name, value in defaults)
        where = f"the model's recommendation in {source}"
        if not any(name == "temperature" for name, _ in defaults):
            chosen, where = f"{chosen}, temperature 1", f"{where}, then OpenAI's default"
    else:
        chosen, where = "temperature 1", f"OpenAI's default: {source} recommends no sampling settings"
    return (
        f"HTTP requests that set no sampling fields sample at {chosen} ({where}); gRPC requests decode greedily "
        "unless they set temperature"
    )


def versions() -> str:
    return f"ovserve {package_version('ovserve')}, OpenVINO {package_version('openvino')}"


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def port_named(host: str, port: int, field: str) -> Iterator[None]:
    """A port that cannot be bound is named with the flag and the variable that change it."""
    try:
        yield
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OSError(
            f"cannot listen on {host}:{port} ({reason}); choose another with --{field.replace('_', '-')} or "
            f"{env_name(field)}"
        ) from None


def check_model(folder: str) -> str | None:
    """Why the model folder cannot be served, in one line (None: it can be read)."""
    try:
        ModelFiles.read(folder)
    except (OSError, ValueError) as exc:
        return f"--model {folder}: {exc}"
    return None


async def run(config: ServerConfig) -> int:
    """Serve until a signal (exit 0) or the engine's death (exit 1); the process's exit code (2: a mistake in
    how it was started, such as a model folder that holds no model or a port that is taken)."""
    problem = check_model(config.model)
    if problem is not None:
        log.error("cannot start: %s", problem)
        return 2
    log.info("starting %s", versions())
    try:
        server = Server(config)
    except (ValueError, OSError) as exc:  # a port is taken, the TLS files do not fit, the token file is empty
        log.error("cannot start: %s", exc)
        return 2
    try:
        await server.start()  # binds the metrics port, starts the HTTP server (its TLS context)
    except (ValueError, OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        await server.drain(grace_seconds=0, delay_seconds=0)  # what did start stops, and its ports are freed
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first signal drains; a second one hurries the drain along
        if stop.is_set():
            log.info("second signal: stopping now")
            server.hurry()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    reloads: set[asyncio.Task[None]] = set()

    def on_hangup() -> None:  # SIGHUP: read the keys file now, changed or not
        task = loop.create_task(server.reload_keys(force=True))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(server.engine_failed.wait())
    await asyncio.wait({load, stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        failure = load.exception()
        if isinstance(failure, (FolderInUse, UnreadableModel)):  # a mistake in how it was started: one line
            log.error("cannot start: %s", failure)
            await server.drain(delay_seconds=0)
            return 2
        log.error("cannot load the model from %s", config.model, exc_info=failure)
        await server.drain(delay_seconds=0)
        return 1
    await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        log.critical("the engine stopped unexpectedly; exiting with status 1")
        await server.drain(grace_seconds=0, delay_seconds=0)  # nothing in flight can finish
        logging.shutdown()
        return 1
    log.info(
        "signal received: draining (%.3g s still serving, then up to %.3g s for requests in flight)",
        config.drain_delay_seconds,
        config.drain_grace_seconds,
    )
    loading = not load.done()
    await server.drain()
    if loading:
        log.info("stopped while loading the model")
        logging.shutdown()
        os._exit(0)  # the loading thread cannot be interrupted; nothing else is left to finish
    return 0
