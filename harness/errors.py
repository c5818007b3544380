"""Every exception the harness raises itself, in one hierarchy (imports nothing).

    RingHarnessError                      anything the harness raises on purpose
    ├── HarnessError (ValueError)         bad input: the CLI prints one line and exits 2
    │   └── ImplError                     an implementation cannot be resolved or cannot run as asked
    │       └── MissingDependency         a built-in adapter's third-party library is not installed
    ├── PoolError (RuntimeError)          the ranks could not start
    ├── CommError (RuntimeError)          a communication op failed or timed out inside a rank
    ├── ShapeError (RuntimeError)         an implementation returned a tensor of the wrong shape
    └── Interrupted                       SIGINT or SIGTERM asked to stop (raised at a safe point, harness.interrupt)

`except RingHarnessError` catches all of them; the built-in bases are kept so that code catching
`ValueError` (bad input) or `RuntimeError` (a run went wrong) keeps working. Errors from the
implementations under test are not wrapped: they are what the harness observes, not what it
raises.
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
    """The root: every exception the harness raises itself (never one raised by an
    implementation)."""


class HarnessError(RingHarnessError, ValueError):
    """Bad input (case file, option, implementation name): the message names the problem on one
    line; the CLI prints it and exits 2."""


class ImplError(HarnessError):
    """An implementation cannot be resolved (unknown name, refused import, broken entry point) or
    cannot run as asked (outside its declared capabilities, unsupported library version); the
    message is one line. Raised inside a rank it makes the run a fail-stop."""


class MissingDependency(ImplError):
    """A built-in adapter's third-party library is not installed (or failed to import); the message
    names the optional extra to install."""


class PoolError(RingHarnessError, RuntimeError):
    """The rank pool could not start: a worker exited, or the ranks did not rendezvous in time."""


class CommError(RingHarnessError, RuntimeError):
    """A communication op failed or timed out inside a rank (fault interposition); the message names
    the op, the peer and the phase."""


class ShapeError(RingHarnessError, RuntimeError):
    """An implementation returned an output or gradient of the wrong shape (verdict: diverged)."""


class Interrupted(RingHarnessError):
    """SIGINT or SIGTERM asked to stop; raised at a safe point (a wait of the rank pool), never from
    inside a signal handler (harness.interrupt). `signal` names it; the command line exits 128 + its
    number."""

    def __init__(self, signal: str, where: str = "") -> None:
        super().__init__(f"interrupted by {signal}" + (f" ({where})" if where else ""))
        self.signal = signal
