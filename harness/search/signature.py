"""A failure's signature: what makes two failing runs the same bug.

Shrinking keeps the signature, so it never swaps one failure for another. A candidate that fails
differently is a different failure, saved and reported on its own, as hypothesis does with distinct
errors. The signature is the implementation plus `judging.verdicts.failure_signature`.
`failure_type` turns a signature into an exception class of its own. Hypothesis tells bugs apart by
exception type and raise site, so it shrinks each signature separately.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.judging.verdicts import failure_signature
from harness.result import CaseResult


@dataclass(frozen=True)
class Signature:
    """One failure class of one implementation: the verdict, then what failed (tensors, leak, error
    type).
    """

    impl: str
    # failure_signature: (verdict, failing tensors / leak / error class, faults)
    parts: tuple[str, ...]

    @classmethod
    def of(cls, r: CaseResult) -> Signature:
        return cls(r.impl, failure_signature(r))

    @property
    def verdict(self) -> str:
        return self.parts[0] if self.parts else ""

    @property
    def what(self) -> tuple[str, ...]:
        """The failing tensors, "leak" and "send-buffer", or the error class; then
        the fault kinds.
        """
        return self.parts[1:]

    def label(self) -> str:
        """Human-readable: 'silent-corruption: dq, leak'."""
        return f"{self.verdict}: {', '.join(self.what)}" if self.what else self.verdict

    def slug(self) -> str:
        """A file-name part: 'silent-corruption-dq+leak'."""
        text = "+".join(self.what)
        return re.sub(r"[^A-Za-z0-9+._-]", "_", f"{self.verdict}-{text}" if text else self.verdict)


class CaseFailed(Exception):
    """A failing case inside the hypothesis test. `failure_type` makes one subclass
    per signature.
    """

    signature: Signature | None = None

    def __init__(self, result: CaseResult) -> None:
        super().__init__(f"{Signature.of(result).label()}: {result.case.summary()}")
        self.result = result


_TYPES: dict[Signature, type[CaseFailed]] = {}


def failure_type(sig: Signature) -> type[CaseFailed]:
    """The exception class of a signature: the same class every time it is asked for."""
    if sig not in _TYPES:
        name = "CaseFailed_" + re.sub(r"\W", "_", sig.slug())
        _TYPES[sig] = type(name, (CaseFailed,), {"signature": sig, "__module__": __name__})
    return _TYPES[sig]


def raise_failure(r: CaseResult) -> None:
    """Raise the failing result as its signature's exception.

    It is the one raise site: hypothesis tells the failures apart by type.
    """
    raise failure_type(Signature.of(r))(r)
