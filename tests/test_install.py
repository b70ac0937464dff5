"""The install's torch step (scripts/install_torch.py): the CPU build from PyTorch's index when it answers, and
when it does not, nothing installed here and a line saying what the fallback costs. Real sockets: a local
HTTP server stands in for the index, a closed port for an unreachable one."""

import contextlib
import http.server
import importlib.util
import threading

import pytest

from tests.support.paths import ROOT
from tests.support.servers import free_port


@pytest.fixture(scope="module")
def install_torch():
    spec = importlib.util.spec_from_file_location("install_torch", ROOT / "scripts/install_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def index(folder):
    (folder / "torch").mkdir()
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_pins_come_from_the_convert_extra(install_torch):
    wanted = install_torch.pins(ROOT / "pyproject.toml")
    assert set(wanted) == {"torch", "torchvision"} and all(v[0].isdigit() for v in wanted.values())


def test_a_reachable_index_gives_the_cpu_build_of_the_pinned_versions(install_torch, tmp_path):
    wanted = {"torch": "2.14.1", "torchvision": "0.29.1"}
    with index(tmp_path) as url:
        message, arguments = install_torch.plan(url, wanted, {"torch": None, "torchvision": None})
    assert message.startswith("torch: the CPU build from")
    assert arguments == ["install", "--index-url", url, "torch==2.14.1", "torchvision==0.29.1"]


def test_an_unreachable_index_installs_nothing_and_says_what_the_fallback_costs(install_torch):
    url = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens there
    message, arguments = install_torch.plan(url, {"torch": "2.14.1", "torchvision": "0.29.1"}, {})
    assert arguments is None
    assert f"{url} cannot be reached" in message and "4 GB of CUDA libraries" in message


def test_an_installed_torch_of_the_pinned_release_is_kept_whichever_build(install_torch, tmp_path):
    wanted = {"torch": "2.14.1", "torchvision": "0.29.1"}
    with index(tmp_path) as url:
        message, arguments = install_torch.plan(url, wanted, {"torch": "2.14.1", "torchvision": "0.29.1+cpu"})
        assert arguments is None and "already installed; kept" in message
        _, arguments = install_torch.plan(url, wanted, {"torch": "2.13.0+cpu", "torchvision": "0.29.1"})
        assert arguments is not None and "torch==2.14.1" in arguments  # another release is replaced
