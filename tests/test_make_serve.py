"""`make serve`'s variables, as a user passes them: the ports, host and model reach the server's flags, what is
left out is left to OVSERVE_* and the server's defaults, and a MODEL other than the default one must already
hold a converted model (make never converts the default model into it). The install stamp is taken as done
(`make -o`): these tests never install anything."""

import subprocess
import sys

from tests.support.paths import ROOT

DEFAULT_MODEL = "models/smollm2-135m-int8"


def make_serve(*variables: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    stamp = f"{sys.prefix}/.installed-runtime"
    command = ["make", *(["-n"] if dry_run else []), "-o", stamp, "serve", f"VENV={sys.prefix}", *variables]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def server_command(result: subprocess.CompletedProcess) -> str:
    joined = result.stdout.replace("\\\n", " ")  # make -n prints the recipe's continued lines as written
    lines = [line for line in joined.splitlines() if " -m service " in line]
    assert len(lines) == 1, result.stdout
    return " ".join(lines[0].split())


def test_the_variables_become_the_servers_flags(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    result = make_serve("PORT=50052", "HTTP_PORT=8001", "METRICS_PORT=9091", "HOST=0.0.0.0", f"MODEL={tmp_path}")
    assert server_command(result).endswith(
        f"-m service --model {tmp_path} --host 0.0.0.0 --port 50052 --http-port 8001 --metrics-port 9091"
    )


def test_variables_left_out_are_left_to_the_environment_and_the_defaults():
    result = make_serve()
    assert server_command(result).endswith(f"-m service --model {DEFAULT_MODEL}")


def test_another_model_folder_is_never_converted_into_and_must_hold_a_model(tmp_path):
    result = make_serve(f"MODEL={tmp_path}", dry_run=False)
    assert result.returncode == 2
    assert f"MODEL={tmp_path} holds no converted model; convert one first" in result.stdout
    assert list(tmp_path.iterdir()) == [] and "-m convert smollm2" not in result.stdout
