"""API keys naming tenants, without a model: the keys file's rules, reloads, and what a tenant changes."""

import logging
import os
import threading

import pytest

from service.config import parse_args
from service.core.request import DEFAULT_TENANT, Tenant, check_cache_salt, check_priority
from service.errors import InvalidArgument
from service.serving.auth import Auth, KeysFileError, parse_keys, read_keys

ALICE, BOB, ROTATED = "alice-key-0123456789", "bob-key-0123456789ab", "alice-key-new-0123456789"


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_keys_name_tenants_with_weights():
    keys = parse_keys(f"# tenants\n\nalice {ALICE} 2\n  bob\t{BOB}\nalice {ROTATED} 2\n", "keys")
    auth = Auth(keys)
    assert auth.tenant_of(bearer(ALICE)) == Tenant("alice", 2.0, own_cache=True)
    assert auth.tenant_of(bearer(ROTATED)).name == "alice"  # a tenant may have several keys
    assert auth.tenant_of(b"bearer " + BOB.encode()) == Tenant("bob", 1.0, own_cache=True)
    for given in (bearer("nope-0123456789abcdef"), BOB.encode(), b"Basic " + BOB.encode(), b"", None, b"Bearer "):
        assert auth.tenant_of(given) is None
    assert auth.tenants == ["alice", "bob"] and auth.required


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (f"alice {ALICE}\nbob\n", 2, "expected `tenant key [weight]`, got 1 fields"),
        (f"alice {ALICE} 1 extra\n", 1, "got 4 fields"),
        (f"al/ice {ALICE}\n", 1, "a tenant name is 1 to 64"),
        (f"{'a' * 65} {ALICE}\n", 1, "a tenant name is 1 to 64"),
        ("alice short\n", 1, "a key is 16 to 256 visible ASCII characters"),
        ("alice clé-0123456789abcdef\n", 1, "visible ASCII"),
        (f"alice {ALICE} 0\n", 1, "the weight must be a number in [0.001, 1000]"),
        (f"alice {ALICE} 1e-320\n", 1, "the weight must be a number"),  # its charges would reach infinity
        (f"alice {ALICE} nan\n", 1, "the weight must be a number"),
        (f"alice {ALICE} -1\n", 1, "the weight must be a number"),
        (f"alice {ALICE} 1e9\n", 1, "the weight must be a number"),
        (f"alice {ALICE}\n#\nbob {ALICE}\n", 3, "the same key as line 1"),
        (f"alice {ALICE} 1\nalice {ROTATED} 2\n", 2, "tenant alice has weight 1 on line 1"),
    ],
)
def test_a_hostile_keys_file_is_refused_naming_the_line(text, line, reason):
    with pytest.raises(KeysFileError) as refused:
        parse_keys(text, "/etc/keys")
    assert f"/etc/keys line {line}: " in str(refused.value) and reason in str(refused.value)
    assert ALICE not in str(refused.value)  # a key never reaches a message (or the log)


def test_files_that_hold_no_keys_or_no_text_are_refused(tmp_path):
    empty, binary, huge = tmp_path / "empty", tmp_path / "binary", tmp_path / "huge"
    empty.write_text("# nothing yet\n\n")
    binary.write_bytes(f"alice {ALICE}\n".encode() + b"bob \xff\xfe\n")
    huge.write_text("#" * (2 << 20))
    with pytest.raises(KeysFileError, match="no keys"):
        read_keys(str(empty))
    with pytest.raises(KeysFileError, match="line 2: not UTF-8"):
        read_keys(str(binary))
    with pytest.raises(KeysFileError, match="larger than"):
        read_keys(str(huge))
    with pytest.raises(ValueError, match="exclude each other"):
        Auth.from_files(str(empty), str(empty))


def test_a_reload_takes_new_keys_and_a_bad_one_keeps_the_old_with_one_warning(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE}\n")
    auth = Auth.from_files(None, str(path))
    assert not auth.reload()  # unchanged
    path.write_text(f"alice {ROTATED}\nbob {BOB} 3\n")
    assert auth.reload()
    assert auth.tenant_of(bearer(ALICE)) is None and auth.tenant_of(bearer(BOB)).weight == 3.0
    caplog.set_level(logging.WARNING, "service.serving.auth")
    path.write_text(f"bob {BOB}\nbob {BOB}\n")
    os.utime(path, ns=(1, 1))  # another size or time is what marks a change; make sure of it
    for _ in range(3):
        assert not auth.reload()
    assert auth.tenant_of(bearer(BOB)).weight == 3.0  # the previous keys still apply
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "line 2: the same key as line 1" in warnings[0].getMessage()
    path.unlink()
    assert not auth.reload() and auth.tenant_of(bearer(ROTATED)).name == "alice"
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_the_single_token_and_no_auth_are_the_default_tenant(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0k\n")
    assert Auth.from_files(str(token), None).tenant_of(b"Bearer t0k") is DEFAULT_TENANT
    assert Auth().tenant_of(None) is DEFAULT_TENANT and not Auth().required
    assert not DEFAULT_TENANT.own_cache  # its cache is the shared one, as before tenants
    assert Auth.from_files(None, None).tenants == ["default"]


def test_own_caches_never_share_a_salt():
    shared, a, b = Tenant("a"), Tenant("a", own_cache=True), Tenant("b", own_cache=True)
    assert shared.cache_salt("s") == "s"
    salts = {t.cache_salt(s) for t in (a, b) for s in ("", "s", "a", "b")}
    assert len(salts) == 8 and "" not in salts and "s" not in salts
    with pytest.raises(InvalidArgument, match="cache_salt: must not contain the NUL"):
        check_cache_salt("a\x00b")  # or a client of the shared cache could name a tenant's own salt


def test_priority_is_checked_with_its_range():
    check_priority(-1000)
    check_priority(1000)
    with pytest.raises(InvalidArgument, match=r"priority: must be in \[-1000, 1000\], got 1001"):
        check_priority(1001)


def test_flags(tmp_path):
    config = parse_args(["--model", "m", "--api-keys-file", "k", "--max-queued-per-tenant", "8"], env={})
    assert config.api_keys_file == "k" and config.engine.max_queued_per_tenant == 8 and config.engine.fair_admission
    assert not parse_args(["--model", "m", "--no-fair-admission"], env={}).engine.fair_admission
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--api-keys-file", "k", "--auth-token-file", "t"], env={})
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--max-queued-per-tenant", "-1"], env={})


def test_a_keys_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, caplog):
    path, fifo = tmp_path / "keys", tmp_path / "fifo"
    path.write_text(f"alice {ALICE} 0.001\n")
    auth = Auth.from_files(None, str(path))
    assert auth.tenant_of(bearer(ALICE)).weight == 0.001  # the smallest weight
    os.mkfifo(fifo)
    path.unlink()
    path.symlink_to(fifo)  # nobody ever writes to it: opening it to read would wait for good
    caplog.set_level(logging.WARNING, "service.serving.auth")
    reload = threading.Thread(target=auth.reload, daemon=True)
    reload.start()
    reload.join(10)
    assert not reload.is_alive()
    assert "not a regular file" in caplog.text and auth.tenant_of(bearer(ALICE)) is not None  # the old keys
    for given in ({"keys_file": str(path)}, {"token_file": str(fifo)}, {"keys_file": str(tmp_path)}):
        with pytest.raises(KeysFileError, match="not a regular file"):
            Auth.from_files(given.get("token_file"), given.get("keys_file"))
    binary = tmp_path / "token"
    binary.write_bytes(b"\xff" * 20)  # a token no client could send back as it is read
    with pytest.raises(KeysFileError, match="not UTF-8"):
        Auth.from_files(str(binary), None)


def test_sighup_reads_the_file_even_when_it_looks_unchanged(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE}\n")
    auth = Auth.from_files(None, str(path))
    before = path.stat()
    path.write_text(f"alice {ALICE[:-1]}Z\n")  # same size, and (below) the same time: not seen by polling
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert not auth.reload() and auth.tenant_of(bearer(ALICE)) is not None
    assert auth.reload(force=True) and auth.tenant_of(bearer(ALICE)) is None


def test_a_hostile_keys_file_stops_the_start_naming_the_line(tmp_path):
    from service.config import ServerConfig
    from service.process import Server

    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE}\nbob\tshort\n")
    config = ServerConfig(model="unused", port=0, http_port=0, metrics_port=0, api_keys_file=str(path))
    with pytest.raises(KeysFileError, match=rf"{path} line 2: a key is 16 to 256"):
        Server(config)
