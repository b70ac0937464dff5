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
server per worker) and converts in the background too (tests/support/models.py); tests/support/parallel.py says
which tests go to one worker together, in this order.
"""

import pytest

from tests.support import models, parallel
from tests.support.models import (  # noqa: F401 (fixtures)
    BUILDS,
    MODEL_FIXTURES,
    smollm2_ir,
    tiny_qwen3_fp16_ir,
    tiny_qwen3_hf,
    tiny_qwen3_int4_ir,
    tiny_qwen3_ir,
)
from tests.support.parallel import (  # noqa: F401 (hooks)
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    groups = parallel.groups(items, MODEL_FIXTURES)
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
    parallel.save(config, groups)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        used = (MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())) for item in session.items)
        models.start(set().union(*used))


def pytest_sessionfinish(session: pytest.Session) -> None:
    models.stop()
