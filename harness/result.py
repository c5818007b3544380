"""What a saved case records about its run: versions, backend, verdict, per-rank/per-tensor errors
and tolerances, and a hash of every output shard (for bit-for-bit replay)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

import torch

from harness import case as case_mod
from harness.runner import CaseResult


def harness_version() -> str:
    try:
        return metadata.version("ring-harness")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def result_record(r: CaseResult, impl_version: str = "unknown", backend: str = "gloo") -> dict:
    """The `result:` block of a case file."""
    return {
        "verdict": r.verdict,
        "detail": r.detail,
        "versions": {"torch": str(torch.__version__), "ring-harness": harness_version(), "impl": impl_version,
                     "python": platform.python_version()},
        "backend": backend,
        "checks": [{"tensor": c.tensor, "rank": c.rank, "error": float(c.error), "allowed": float(c.allowed),
                    "ratio": float(c.ratio) if c.ratio != float("inf") else "inf", "position": c.position}
                   for c in r.checks],
        "leak": None if r.leak is None else {"queries": r.leak.queries, "leaks": r.leak.leaks},
        "errors": {int(k): v for k, v in r.errors.items()},
        "hashes": {int(k): dict(v) for k, v in r.hashes.items()},
    }


def failure_path(directory: str | os.PathLike, r: CaseResult, name: str | None = None) -> Path:
    stem = name or f"{r.impl.replace(':', '_').replace('/', '_')}-{r.verdict}-{r.case.key()}"
    return Path(directory) / f"{stem}.yaml"


def save_result(r: CaseResult, directory: str | os.PathLike, *, name: str | None = None, note: str | None = None,
                impl_version: str = "unknown", backend: str = "gloo") -> Path:
    """Write the case and its recorded result atomically; returns the path."""
    text_note = note or f"{r.verdict}: {r.case.summary()}\n{r.detail}"
    return case_mod.save(r.case, failure_path(directory, r, name),
                         result=result_record(r, impl_version, backend), note=text_note)
