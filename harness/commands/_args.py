"""Turning parsed arguments into an options dataclass: options left out on the command line take the
dataclass's default (arguments are declared with `default=argparse.SUPPRESS`), so every default
lives once, in harness/checks/options.py."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def build(cls: type[T], args: argparse.Namespace, **renamed: str) -> T:
    """`cls(**given)` from the attributes of `args` that name a field of `cls` (`renamed` maps a
    field to the argument's dest where they differ)."""
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


def add_placement(p: argparse.ArgumentParser) -> None:
    """--device and --stage-p2p (check, the fault battery, selftest)."""
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=argparse.SUPPRESS,
        help="where the local pool's ranks compute: cpu, or cuda (W gloo ranks on the "
        "visible GPUs, "
        "round-robin, P2P staged through pinned host memory; docs/gpu.md)",
    )
    p.add_argument(
        "--stage-p2p",
        action="store_true",
        default=argparse.SUPPRESS,
        help="stage P2P through host buffers on CPU ranks too, as --device cuda does "
        "(NCCL's per-peer "
        "FIFO matching, one Work per batch_isend_irecv)",
    )
