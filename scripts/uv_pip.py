"""`uv pip install ARGS` into this Python's environment, configured as pip is here.

    python scripts/uv_pip.py [--dry-run] ARGS...      (the install steps of the Makefile run this)

uv installs in parallel: the development install takes 15-47 s where pip took 140 s on 2 cores. uv does not
read pip's configuration, so this passes it on, read from `pip config list` (files and PIP_* variables): the
index, extra indexes, find-links, no-index, constraints, trusted hosts, proxy, certificate bundle and timeout.
uv looks for a package on its first index only unless told otherwise; pip takes the best version from all of
them, and so does this."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# pip's option: uv's flag (options that may hold several values, separated by whitespace)
LISTS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# where an option is set in several places, pip takes the environment's, then the install section's
PRECEDENCE = {":env:": 0, "install": 1, "global": 2}


def pip_config(listing: str) -> dict[str, str]:
    """{option: value} from `pip config list` lines (`section.option='value'`), by pip's PRECEDENCE."""
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, _, option = key.rpartition(".")
        if not sep or section not in PRECEDENCE:
            continue
        rank = PRECEDENCE[section]
        if option not in found or rank < found[option][0]:
            found[option] = (rank, value.strip().strip("'\""))
    return {option: value for option, (_, value) in found.items()}


def uv_arguments(config: dict[str, str], compile_bytecode: bool = False) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for pip's options."""
    flags = ["--compile-bytecode"] if compile_bytecode else []
    flags += ["--index-strategy", "unsafe-best-match"]
    if "index-url" in config:
        flags += ["--index-url", config["index-url"]]
    for option, flag in LISTS.items():
        for value in config.get(option, "").split():
            flags += [flag, value]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
    env = {}
    if "proxy" in config:
        env["HTTPS_PROXY"] = env["HTTP_PROXY"] = config["proxy"]
    if "cert" in config:
        env["SSL_CERT_FILE"] = config["cert"]
    if "default-timeout" in config:
        env["UV_HTTP_TIMEOUT"] = config["default-timeout"]
    return flags, env


def redacted(line: str) -> str:
    """The line with the passwords of URLs (an index's or a proxy's `user:password@`) masked, as pip masks them."""
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1****@", line)


def main(argv: list[str]) -> int:
    dry_run = argv[:1] == ["--dry-run"]
    args = argv[1:] if dry_run else argv
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    # Python caches a module's bytecode when it first imports it, unless told not to (PYTHONDONTWRITEBYTECODE,
    # -B): then every process would compile torch and transformers again (a conversion took 41.7 s instead of
    # 28.9 s), so everything is compiled here, as pip always does (30 s more of install on 2 cores)
    flags, env = uv_arguments(pip_config(listing), compile_bytecode=sys.flags.dont_write_bytecode)
    uv = Path(sys.executable).with_name("uv")
    command = [str(uv), "pip", "install", "--python", sys.executable, *flags, *args]
    print(redacted(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command)])), flush=True)
    if dry_run:
        return 0
    return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
