"""Every exception the harness raises itself, in one hierarchy. It imports nothing.

`except RingHarnessError` catches all of them. Each keeps a built-in base, ValueError for bad input
or RuntimeError for a run gone wrong, so older handlers keep working. Errors from the
implementations under test are not wrapped. docs/api.md draws the tree.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "HarnessError",
    "ImplError",
    "Interrupted",
    "MissingDependency",
    "PoolError",
    "RingHarnessError",
    "ShapeError",
]


class RingHarnessError(Exception):
    """The root: every exception the harness raises itself, never one an implementation raised."""


class HarnessError(RingHarnessError, ValueError):
    """Bad input: a case file, an option, an implementation name.

    The message names the problem on one line. The CLI prints it and exits 2.
    """


class ImplError(HarnessError):
    """An implementation cannot be resolved, or cannot run as asked. The message is one line.

    It cannot be resolved for an unknown name, a refused import or a broken entry point. It cannot
    run as asked outside its declared capabilities, or with an unsupported library version. Raised
    inside a rank, it makes the run a fail-stop.
    """


class MissingDependency(ImplError):
    """A built-in adapter's third-party library is not installed, or failed to import.

    The message names the optional extra to install.
    """


class PoolError(RingHarnessError, RuntimeError):
    """The rank pool could not start: a worker exited, or the ranks did not rendezvous in time."""


class CommError(RingHarnessError, RuntimeError):
    """A communication op failed or timed out inside a rank, under fault interposition.

    The message names the op, the peer and the phase.
    """


class ShapeError(RingHarnessError, RuntimeError):
    """An implementation returned an output or gradient of the wrong shape: diverged."""


class Interrupted(RingHarnessError):
    """SIGINT or SIGTERM asked to stop.

    It is raised at a safe point, a wait of the rank pool, never from inside a signal handler
    (harness.interrupt). `signal` names the signal, and the command line exits 128 + its number.
    """

    def __init__(self, signal: str, where: str = "") -> None:
        super().__init__(f"interrupted by {signal}" + (f" ({where})" if where else ""))
        self.signal = signal
