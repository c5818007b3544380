"""Turning parsed arguments into an options dataclass: options left out on the command line take the
dataclass's default (arguments are declared with `default=argparse.SUPPRESS`), so every default lives
once, in harness/checks/options.py."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def build(cls: type[T], args: argparse.Namespace, **renamed: str) -> T:
    """`cls(**given)` from the attributes of `args` that name a field of `cls` (`renamed` maps a field
    to the argument's dest where they differ)."""
    given: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        dest = renamed.get(f.name, f.name)
        if hasattr(args, dest):
            given[f.name] = getattr(args, dest)
    return cls(**given)


def hint(cls: type, name: str) -> str:
    """' (default X)' for a help text."""
    from harness.checks.options import default

    d = default(cls, name)
    if isinstance(d, tuple):
        d = ",".join(d)
    return f" (default {d})" if d not in (None, "") else ""
