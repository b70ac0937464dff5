"""The install's torch step (scripts/install_torch.py): the CPU build from PyTorch's index when it answers, and
when it does not, nothing installed here and a line saying what the fallback costs. Real sockets: a local
HTTP server stands in for the index, a closed port for an unreachable one. And the install's uv runs
(scripts/uv_pip.py): configured as pip is."""

import contextlib
import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
import tomllib
from importlib import metadata

import pytest

from tests.support.paths import ROOT
from tests.support.servers import free_port


def script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def install_torch():
    return script("install_torch")


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
    assert set(wanted) == {"torch"} and all(v[0].isdigit() for v in wanted.values())


def test_a_reachable_index_gives_the_cpu_build_of_the_pinned_versions(install_torch, tmp_path):
    wanted = {"torch": "2.13.0"}
    with index(tmp_path) as url:
        message, arguments = install_torch.plan(url, wanted, {"torch": None})
    assert message.startswith("torch: the CPU build from")
    assert arguments == ["install", "--index-url", url, "torch==2.13.0"]


def test_an_unreachable_index_installs_nothing_and_says_what_the_fallback_costs(install_torch):
    url = f"http://127.0.0.1:{free_port()}/whl/cpu"  # nothing listens there
    message, arguments = install_torch.plan(url, {"torch": "2.13.0"}, {})
    assert arguments is None
    assert f"{url} cannot be reached" in message and "4 GB of CUDA libraries" in message


def test_an_installed_torch_of_the_pinned_release_is_kept_whichever_build(install_torch, tmp_path):
    wanted = {"torch": "2.13.0"}
    with index(tmp_path) as url:
        for build in ("2.13.0", "2.13.0+cpu"):
            message, arguments = install_torch.plan(url, wanted, {"torch": build})
            assert arguments is None and "already installed; kept" in message
        _, arguments = install_torch.plan(url, wanted, {"torch": "2.14.1+cu130"})
        assert arguments is not None and "torch==2.13.0" in arguments  # another release is replaced


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=~!;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_convert_extra_carries_optimum_intels_requirements_but_torchvision():
    """optimum-intel is installed with --no-deps (its torchvision would bring PyPI's CUDA torch): every other
    requirement it declares must come from the convert extra, and both installs pin the same release."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = {requirement_name(r) for r in project["dependencies"] + project["optional-dependencies"]["convert"]}
    declared = [r for r in metadata.requires("optimum-intel") or [] if "extra ==" not in r]
    needed = {requirement_name(r) for r in declared} - {"torchvision"}
    assert needed and needed <= listed, f"missing from the convert extra: {needed - listed}"
    pins = {
        path: re.findall(r"optimum-intel==[\d.]+", (ROOT / path).read_text())
        for path in ("Makefile", "deploy/Dockerfile.convert")
    }
    assert all(found == [f"optimum-intel=={metadata.version('optimum-intel')}"] for found in pins.values()), pins


def test_a_cpu_torch_comes_without_cuda_libraries():
    torch = metadata.version("torch")
    if not torch.endswith("+cpu"):
        pytest.skip(f"torch {torch} is PyPI's build (PyTorch's CPU index was not reachable at install)")
    cuda = sorted(d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith("nvidia-"))
    assert not cuda and not importlib.util.find_spec("triton") and not importlib.util.find_spec("torchvision")


@pytest.mark.parametrize("cached", [True, False], ids=["bytecode-cached", "bytecode-not-written"])
def test_uv_is_given_pips_configuration_the_environment_first(cached):
    """A real `pip config list` (config files left out): every option the install depends on reaches uv, and pip's
    best-version-of-all-indexes rule with them; where Python may not cache bytecode, it is compiled at install."""
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://mirror.example/simple",
        "PIP_EXTRA_INDEX_URL": "file:///one file:///two",
        "PIP_FIND_LINKS": "/wheels",
        "PIP_CONSTRAINT": "/etc/limits.txt",
        "PIP_CERT": "/etc/ca.pem",
        "PIP_DEFAULT_TIMEOUT": "99",
    }
    env.pop("PIP_NO_INDEX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not cached:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/uv_pip.py"), "--dry-run", "--no-deps", "x==1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("SSL_CERT_FILE=/etc/ca.pem UV_HTTP_TIMEOUT=99 "), out
    command = out.split(" ", 2)[2].split()
    assert command[1:5] == ["pip", "install", "--python", sys.executable], command
    assert (command[5] == "--compile-bytecode") == (not cached), command
    flags = " ".join(command[5 if cached else 6 :])
    assert flags == (
        "--index-strategy unsafe-best-match --index-url http://mirror.example/simple "
        "--extra-index-url file:///one --extra-index-url file:///two --find-links /wheels "
        "--constraint /etc/limits.txt --no-deps x==1"
    ), flags


def test_a_config_files_option_gives_way_to_the_environments():
    uv_pip = script("uv_pip")
    listing = (
        "global.find-links='/a'\n:env:.find-links='/b'\ninstall.index-url='u'\nglobal.index-url='g'\n"
        "install.proxy='p'\nsite.cert='c'\nnoise\n"
    )
    assert uv_pip.pip_config(listing) == {"find-links": "/b", "index-url": "u", "proxy": "p"}
    flags, env = uv_pip.uv_arguments({"no-index": "true", "trusted-host": "a b", "proxy": "http://p:3128"})
    assert flags == [
        "--index-strategy", "unsafe-best-match", "--allow-insecure-host", "a", "--allow-insecure-host", "b",
        "--no-index",
    ]  # fmt: skip
    assert env == {"HTTPS_PROXY": "http://p:3128", "HTTP_PROXY": "http://p:3128"}
    line = "HTTPS_PROXY=http://me:s3cret@proxy:3128 uv --index-url https://tok:abc%40d@mirror/simple --find-links /w"
    assert uv_pip.redacted(line) == (
        "HTTPS_PROXY=http://me:****@proxy:3128 uv --index-url https://tok:****@mirror/simple --find-links /w"
    )
