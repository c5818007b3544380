"""A stop request from SIGINT or SIGTERM, as a flag read at safe points.

The signal handler only sets the flag: no exception is ever raised from inside a signal handler, so
no lock (Popen's, a logging lock, the pool's) can be left held half-way. The rank pool polls the
flag while it waits for ranks and raises `Interrupted` there; the checks' loops read it at every
case boundary and finish with what ran. A second signal of the same kind while the first is handled
restores the default action and re-sends itself: the user insisted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from harness.errors import Interrupted

POLL_S = 0.2  # how often a blocking wait looks at the flag
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}

_REQUEST: dict[str, str | None] = {"signal": None}


def requested() -> str | None:
    """The name of the signal that asked to stop ('SIGTERM', 'SIGINT'), or None."""
    return _REQUEST["signal"]


def request(name: str) -> None:
    """Ask every check and wait to stop at its next safe point."""
    _REQUEST["signal"] = name


def clear() -> None:
    _REQUEST["signal"] = None


def check(where: str = "") -> None:
    """Raise Interrupted at a safe point when a stop was requested."""
    name = requested()
    if name is not None:
        raise Interrupted(name, where)


def _handler(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if requested() == name:  # the second one: the default action, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    request(name)


@contextlib.contextmanager
def handlers() -> Iterator[None]:
    """SIGINT and SIGTERM set the flag while the block runs (main thread only; elsewhere a
    no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear()
    previous = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        clear()
