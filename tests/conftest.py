"""Session fixtures (converted models, shared servers) from tests/support, the `model` marker, and the order
of a run.

A test is marked `model` when it uses a converted model, directly or through a server (its fixture closure
holds one of the model fixtures). `make test-unit` runs `-m "not model"`: everything that needs neither a
model nor a server subprocess. A marker computed from fixtures, not a folder: a module keeps its unit tests
beside the integration tests of the same subject, and a new test that takes a model leaves the unit run by
itself.

The tests that need no model run first, while the models the others need are converted in the background;
then the others, by the last model they need in the order the models are built (the first of them can start
while the later models are still being converted).

Under pytest-xdist (`make test`: two workers, `--dist loadgroup`) each worker has its own session fixtures (a
server per worker) and converts in the background too (tests/support/models.py); the tests of a module that
need a model and share one of its costly module-scoped fixtures (a server or an engine of the module's own,
or its autouse state) go to one worker together, so that fixture is built once; every other test goes to
whichever worker is free.
"""

import pytest

from tests.support import models
from tests.support.models import (  # noqa: F401 (fixtures)
    BUILDS,
    MODEL_FIXTURES,
    smollm2_ir,
    tiny_qwen3_fp16_ir,
    tiny_qwen3_hf,
    tiny_qwen3_int4_ir,
    tiny_qwen3_ir,
)
from tests.support.served import (  # noqa: F401 (fixtures)
    limits_server,
    secure_server,
    smol_server,
    tiny_server,
    tools_server,
)

BUILD_ORDER = list(BUILDS)


def _phase(item: pytest.Item) -> int:
    """-1 for a test without a model; else the place in BUILDS of the last model it needs (one asked for at run
    time is not known: after all of them)."""
    if item.get_closest_marker("model") is None:
        return -1
    used = MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    return max((BUILD_ORDER.index(name) for name in used), default=len(BUILD_ORDER))


def _costly_module_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped fixtures in the test's closure that build something of their own from a model (a
    server, an engine: they ask for a model fixture themselves) or hold the module's state (autouse); not those
    that only pass on a session server. From pytest's record of the closure: it has no public accessor."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    found = []
    for name, defs in info.name2fixturedefs.items():
        if not defs or defs[-1].scope != "module":
            continue
        for_its_effect = name in info.initialnames and name not in info.argnames  # autouse or usefixtures
        if MODEL_FIXTURES.intersection(defs[-1].argnames) or for_its_effect:
            found.append(name)
    return sorted(found)


def _shared_groups(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """The model tests that share a costly module-scoped fixture, directly or through another test of their
    module, each under one name: its module and the first such fixture of its group."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def root(key: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keyed: dict[pytest.Item, tuple[str, str]] = {}
    for item in items:
        if item.get_closest_marker("model") is None:
            continue
        module = item.nodeid.split("::", 1)[0]
        keys = [(module, name) for name in _costly_module_fixtures(item)]
        if keys:
            keyed[item] = keys[0]
            for key in keys:
                parent[root(key)] = root(keys[0])
    names: dict[tuple[str, str], str] = {}
    for key in sorted(parent):  # the first fixture by name names its group
        names.setdefault(root(key), f"{key[0].rsplit('/', 1)[-1].removesuffix('.py')}:{key[1]}")
    return {item: names[root(key)] for item, key in keyed.items()}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns xdist_group marks into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    groups = _shared_groups(items)
    phase = {item: _phase(item) for item in items}
    for name in set(groups.values()):  # a group runs when its last model is ready
        members = [item for item, group in groups.items() if group == name]
        latest = max(phase[item] for item in members)
        phase.update(dict.fromkeys(members, latest))
    module_order: dict[str, int] = {}
    for item in items:
        module_order.setdefault(item.nodeid.split("::", 1)[0], len(module_order))
    position = {item: i for i, item in enumerate(items)}
    # stable within a module: its tests keep their order within each phase
    items.sort(key=lambda item: (phase[item], module_order[item.nodeid.split("::", 1)[0]], position[item]))
    if config.getoption("dist", "no") == "loadgroup":
        for item, name in groups.items():
            item.add_marker(pytest.mark.xdist_group(name))


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        used = (MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())) for item in session.items)
        models.start(set().union(*used))


def pytest_sessionfinish(session: pytest.Session) -> None:
    models.stop()
