"""Session fixtures (converted models, shared servers) from tests/support, and the `model` marker.

A test is marked `model` when it uses a converted model, directly or through a server (its fixture closure
holds one of the model fixtures). `make test-unit` runs `-m "not model"`: everything that needs neither a
model nor a server subprocess. A marker computed from fixtures, not a folder: a module keeps its unit tests
beside the integration tests of the same subject, and a new test that takes a model leaves the unit run by
itself.

The tests that need no model run first, while the models the others need are converted in the background.

`make test` runs on two pytest-xdist workers with `--dist loadfile`: a test module stays on one worker, so its
module fixtures (a server, an engine) are built once; each worker has its own session fixtures and converts
in the background too, one process at a time per model (tests/support/models.py).
"""

import pytest

from tests.support import models
from tests.support.models import (  # noqa: F401 (fixtures)
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    items.sort(key=lambda item: item.get_closest_marker("model") is not None)  # stable: in order within each


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        used = (MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())) for item in session.items)
        models.start(set().union(*used))


def pytest_sessionfinish(session: pytest.Session) -> None:
    models.stop()
