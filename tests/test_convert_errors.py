"""Each failure is one clear line on stderr, exit code 2, no traceback, and OUTPUT_DIR as it was:
absent stays absent, and an existing model (even with --force) keeps every byte."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import run_cli


def _existing_output(path: Path) -> dict[str, bytes]:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"source": "earlier-model", "fingerprint": "x", "options": {}}))
    (path / "openvino_model.xml").write_text("<net/>")
    return _snapshot(path)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _assert_clean_failure(result, out: Path, before: dict | None, *words: str):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for w in words:
        assert w in last, last
    if before is None:
        assert not out.exists()
    else:
        assert _snapshot(out) == before
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, leftovers


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_missing_path(tmp_path: Path, existing: bool):
    out = tmp_path / "out"
    before = _existing_output(out) if existing else None
    result = run_cli("-m", "convert", str(tmp_path / "nope.gguf"), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "no such file")
    result = run_cli("-m", "convert", str(tmp_path / "no" / "such" / "folder"), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "config.json")


@pytest.mark.parametrize("offline", [False, True], ids=["no-network", "HF_HUB_OFFLINE"])
def test_unreachable_hub_says_what_to_do(tmp_path: Path, offline: bool):
    out = tmp_path / "out"
    before = _existing_output(out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if offline else None
    result = run_cli("-m", "convert", "Qwen/Qwen3-4B-Instruct-2507", str(out), "--force", check=False, env=env)
    _assert_clean_failure(result, out, before, "no network", "local model folder", ".gguf")


def test_unsupported_architecture(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    out = tmp_path / "out"
    before = _existing_output(out)
    result = run_cli("-m", "convert", str(src), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "unsupported architecture", "bert")


def test_corrupt_gguf(tmp_path: Path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), check=False), out, None, "GGUF")
    before = _existing_output(out)
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), "--force", check=False), out, before, "GGUF")


@pytest.mark.parametrize(
    ("head", "words"),
    [
        (b"PK\x03\x04", ["not a GGUF file"]),
        (b"GGUF" + struct.pack("<IQQ", 7, 1, 1), ["unknown GGUF version"]),
        (b"GGUF" + struct.pack("<IQQ", 3, 10**9, 1), ["1000000000 tensors"]),
        (b"GGUF" + struct.pack(">IQQ", 3, 1, 10**9), ["1000000000 metadata entries"]),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 1), ["cannot read", "as a GGUF model"]),  # read by the libraries
    ],
    ids=["not-gguf", "version", "tensors", "entries-big-endian", "plausible-header"],
)
def test_a_damaged_gguf_fails_in_one_line(tmp_path: Path, head: bytes, words: list[str]):
    """The header is checked before the converter's libraries load; a plausible header over garbage fails where
    the file is read."""
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(head + os.urandom(4096))
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), check=False), out, None, *words)


def test_a_gguf_cut_inside_its_header_fails_in_one_line(tmp_path: Path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1)[:10])  # a half-written file
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), check=False), out, None, "not a GGUF file")


def _damaged_copy(src: Path, where: Path, name: str, content: str | None) -> Path:
    shutil.copytree(src, where)
    if content is None:
        (where / name).unlink()
    else:
        (where / name).write_text(content)
    return where


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("config.json", "{not json", ["config.json", "not valid JSON"]),
        ("config.json", "[1, 2]", ["config.json", "not a JSON object"]),
        ("model.safetensors", None, ["no weights"]),
        ("tokenizer.json", '{"model": {"vocab"', ["tokenizer.json", "not valid JSON"]),
        ("chat_template.jinja", "{% for m in messages %}{{ m.content }", ["chat template", "does not compile"]),
    ],
    ids=["config-not-json", "config-not-object", "no-weights", "tokenizer-truncated", "template-broken"],
)
def test_a_damaged_source_folder_fails_in_one_line_before_the_export(tiny_qwen3_hf, tmp_path, name, content, words):
    # each was a traceback (some only after the whole export had run), or, for the template, a model that
    # converted and verified but that the server refused to load
    src = _damaged_copy(tiny_qwen3_hf, tmp_path / "src", name, content)
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(src), str(out), check=False), out, None, *words)


def test_the_source_or_a_folder_holding_it_is_never_the_output(tiny_qwen3_hf, tmp_path):
    # --force replaced OUTPUT_DIR even when it was the checkpoint itself: the weights were deleted
    src = tmp_path / "models" / "src"
    shutil.copytree(tiny_qwen3_hf, src)
    before = _snapshot(src)
    for out in (src, src.parent):
        result = run_cli("-m", "convert", str(src), str(out), "--force", check=False)
        assert result.returncode == 2 and "would delete the checkpoint" in result.stderr, result.stderr[-2000:]
        assert _snapshot(src) == before


def test_an_output_dir_under_a_file_or_a_symlink_loop_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out in (tmp_path / "file" / "out", tmp_path / "loop" / "out"):
        result = run_cli("-m", "convert", str(tmp_path / "nope.gguf"), str(out), check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_control_characters_from_the_input_are_escaped_in_the_error(tmp_path):
    # names and GGUF metadata reach error lines: a terminal escape in them moved the cursor and faked lines
    hostile = tmp_path / "x\x1b[2K\r\x1b[32mdone: /srv/models\x1b[0m\n.gguf"
    result = run_cli("-m", "convert", str(hostile), str(tmp_path / "out"), check=False)
    assert result.returncode == 2 and "\x1b" not in result.stderr and "\r" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no such file") and "\\x1b[32mdone" in last and "\\n.gguf" in last


def test_a_conversion_never_removes_a_live_conversions_folder(tmp_path):
    # the partial folder of a run into "m.2507" (".m.2507.<pid>.<random>.partial") was taken for one left by a
    # run into "m" by process 2507, and removed under the live run
    from convert.export import remove_stale_partials

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = tmp_path / f".m.2507.{os.getpid()}.abcd1234.partial"
    stale = tmp_path / f".m.{int(dead.stdout)}.efgh5678.partial"
    for folder in (live, stale):
        folder.mkdir()
    remove_stale_partials(tmp_path / "m")
    assert live.exists() and not stale.exists()


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_no_write_permission(tiny_qwen3_hf: Path, tmp_path: Path):
    """A folder without write permission (or, as root, who ignores permissions, a read-only filesystem)."""
    locked = tmp_path / "locked"
    if os.geteuid() == 0:
        if not _mount_tmpfs(locked, "ro,size=1m"):
            pytest.skip("root, and cannot mount a read-only tmpfs here")
    else:
        locked.mkdir(mode=0o500)
    try:
        out = locked / "out"
        result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), check=False)
        _assert_clean_failure(result, out, None, "no write permission")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(locked)], check=False)
        else:
            locked.chmod(0o700)


@pytest.mark.slow
def test_full_disk(tiny_qwen3_hf: Path, tmp_path: Path):
    """A tmpfs too small for the IR stands for a full disk (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "size=2m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "out"
        before = _existing_output(out)
        result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), "--force", check=False)
        _assert_clean_failure(result, out, before, "no space left")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_serving_only_install_is_told_how_to_get_the_converter(tmp_path: Path):
    """Without torch and optimum (make install-runtime), one line naming them and the target that installs them."""
    hide = "import sys; sys.modules['torch'] = sys.modules['optimum'] = None; from convert.__main__ import main; "
    result = run_cli("-c", hide + f"sys.exit(main(['smollm2', {str(tmp_path / 'out')!r}]))", check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: converting needs the converter's packages, and torch, optimum cannot be imported: run "
        "`make install-convert` (or `pip install -e '.[convert]'`)"
    ]
    assert not (tmp_path / "out").exists()


def test_convert_help_explains_sources_formats_and_output():
    from convert.__main__ import _parser, _verify_parser

    result = run_cli("-m", "convert", "--help")
    text = " ".join(result.stdout.split())
    for words in ("smollm2", "local Hugging Face model folder", "Hugging Face Hub", ".gguf", "qwen3"):
        assert words in text, words
    for words in ("int8 (default)", "int4:", "fp16: uncompressed", "generation_config.json", "manifest.json"):
        assert words in text, words
    assert "python -m convert verify DIR" in text
    for parser in (_parser(), _verify_parser()):  # every flag and argument says what it is for
        assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]
