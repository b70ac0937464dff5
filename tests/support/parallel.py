"""Which tests go to one pytest-xdist worker together (`make test`: `-n 2 --dist loadgroup`).

The tests of a module that share one of its costly module-scoped fixtures (what the module builds of its own:
a server or an engine from a model, a tokenizer, a Redis server, a browser; or its autouse state) form a group:
one worker runs them all, in their order, so that fixture is built once and a test that relies on an earlier
one's effect on it still finds it. Every other test goes alone to whichever worker is free. Session fixtures
(the shared servers) are per worker.

pytest-xdist's own loadgroup scheduling carries a test's group in its node id, which pytest 9.2's node ids no
longer allow: the groups are dropped without a word and every test is scheduled alone (pytest-xdist issue
#1386). So the groups travel beside the collection: the controller names a folder (`pytest_configure_node`),
each worker writes the groups of its collection there, and the controller's scheduler reads them once every
worker has collected (the workers report their collection only after writing)."""

import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest

FOLDER = pytest.StashKey[Path]()
INPUT = "ovserve_test_groups"  # the folder's key in the workers' input


def _costly_module_fixtures(item: pytest.Item, models: frozenset[str]) -> list[str]:
    """The module-scoped fixtures in the test's closure that build something of their own: from a model (they ask
    for one of `models` themselves: a server, an engine), without any (a tokenizer, a Redis server, a browser), or
    hold the module's state (autouse); not those that only pass on a session server or what one serves. From
    pytest's record of the closure: it has no public accessor."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []

    def closure(name: str) -> set[str]:
        seen: set[str] = set()
        todo = [name]
        while todo:
            current = todo.pop()
            defs = info.name2fixturedefs.get(current)
            if defs and current not in seen:
                seen.add(current)
                todo.extend(defs[-1].argnames)
        return seen

    found = []
    for name, defs in info.name2fixturedefs.items():
        if not defs or defs[-1].scope != "module":
            continue
        for_its_effect = name in info.initialnames and name not in info.argnames  # autouse or usefixtures
        from_a_model = bool(models.intersection(defs[-1].argnames))
        if for_its_effect or from_a_model or not models.intersection(closure(name)):
            found.append(name)
    return sorted(found)


def groups(items: Iterable[pytest.Item], models: frozenset[str]) -> dict[pytest.Item, str]:
    """The tests that share a costly module-scoped fixture, directly or through another test of their module,
    each under one name: its module and the first such fixture of its group."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def root(key: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keyed: dict[pytest.Item, tuple[str, str]] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        keys = [(module, name) for name in _costly_module_fixtures(item, models)]
        if keys:
            keyed[item] = keys[0]
            for key in keys:
                parent[root(key)] = root(keys[0])
    names: dict[tuple[str, str], str] = {}
    for key in sorted(parent):  # the first fixture by name names its group
        names.setdefault(root(key), f"{key[0]}::{key[1]}")
    return {item: names[root(key)] for item, key in keyed.items()}


def save(config: pytest.Config, found: dict[pytest.Item, str]) -> None:
    """On a worker: the groups of its collection, for the controller's scheduler."""
    folder = getattr(config, "workerinput", {}).get(INPUT)
    if folder is None:  # not a worker, or the controller is not scheduling by group
        return
    worker = config.workerinput["workerid"]
    partial = Path(folder) / f"{worker}.partial"
    partial.write_text(json.dumps({item.nodeid: name for item, name in found.items()}))
    partial.replace(Path(folder) / f"{worker}.json")  # whole, or not there


def _read(folder: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for written in sorted(folder.glob("*.json")):
        found.update(json.loads(written.read_text()))  # every worker collected the same tests
    return found


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """On the controller, for each worker it starts: where to write its groups."""
    config = node.config
    if config.getoption("dist") != "loadgroup":
        return
    if FOLDER not in config.stash:
        config.stash[FOLDER] = Path(tempfile.mkdtemp(prefix="ovserve-test-groups-"))
    node.workerinput[INPUT] = str(config.stash[FOLDER])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """On the controller, for --dist loadgroup: pytest-xdist's scope scheduling with this module's groups as
    scopes, in the collection's order (tests/conftest.py orders it: no model first, then by model)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def __init__(self) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first asked once every worker has collected (and written its groups)
                folder = config.stash.get(FOLDER, None)
                self.groups = _read(folder) if folder else {}
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # largest scope first would put groups that wait for models first
    return GroupScheduling()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
