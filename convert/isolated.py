"""Run the heavy part of a conversion in a child process that this process can always stop.

Why: an interrupt delivered inside the converting libraries is not always an exception that reaches
us. Measured here: Ctrl-C during the OpenVINO front end came back as an OpConversionFailure, once as
an abort (SIGABRT), and once the conversion ran on and published the model. With the work in a child,
this process only waits; on Ctrl-C or SIGTERM it kills the child and removes the temporary folder,
and a child that crashes is reported in one line instead of leaving a half-written folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

from convert.errors import ConvertError, printable

_PR_SET_PDEATHSIG = 1


class _PrintableFormatter(logging.Formatter):
    """Messages with control characters escaped but for line breaks (they quote names from the files converted;
    a table of several lines keeps its lines, and tracebacks, added after the message, are left as they are)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802
        return "\n".join(printable(line) for line in super().formatMessage(record).split("\n"))


def configure_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for noisy in ("nncf", "transformers", "torch", "optimum"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def run_isolated(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) in a spawned child. Its ConvertError, OSError and RuntimeError are raised again here."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(os.getpid(), sender, fn, args), name="convert-worker")
    child.start()
    sender.close()
    try:
        outcome = receiver.recv() if receiver.poll(None) else None
    except EOFError:  # the child died without reporting
        outcome = None
    except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt by the CLI)
        child.kill()
        child.join()
        raise
    finally:
        receiver.close()
    child.join()
    if outcome is None:
        code = child.exitcode or 0
        how = f"died of {signal.Signals(-code).name}" if code < 0 else f"failed with exit code {code} (see above)"
        raise ConvertError(f"the conversion process {how}; nothing was written to the output folder")
    kind, detail = outcome
    if kind == "ConvertError":
        raise ConvertError(detail)
    if kind == "OSError":
        raise OSError(*detail)
    if kind == "RuntimeError":  # the caller may turn it into a one-line error (a failed write on a full disk)
        message, child_traceback = detail
        error = RuntimeError(message)
        error.add_note(f"in the conversion process:\n{child_traceback}")
        raise error


def _child_main(parent_pid: int, sender, fn: Callable[..., Any], args: tuple) -> None:
    # the parent decides when to stop: a terminal's Ctrl-C reaches the whole process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # and if the parent is killed outright, the child must not keep writing into a folder that the
    # next run will treat as abandoned
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
    configure_logging()
    try:
        fn(*args)
        outcome: tuple[str, Any] = ("ok", None)
    except ConvertError as exc:
        outcome = ("ConvertError", str(exc))
    except OSError as exc:
        outcome = ("OSError", (exc.errno, exc.strerror or str(exc)))
    except RuntimeError as exc:
        outcome = ("RuntimeError", (str(exc), traceback.format_exc()))
    sender.send(outcome)
    sender.close()
