"""What one case run produced, and the record a saved case file keeps of it.

`CaseResult` holds the verdict, one of `Verdict`, with per-rank and per-tensor checks, errors,
stacks and hashes. The `result:` block of a case file records versions, platform, verdict, errors,
tolerances and a hash of every output shard, for replay bit for bit. The rules that decide a
verdict live in `harness.judging.verdicts`.
"""

from __future__ import annotations

import enum
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from harness import case as case_mod
from harness.case import Case

TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


class Verdict(str, enum.Enum):
    """How a run ended; exactly one per case.

    pass: every rank correct. silent-corruption: completed with wrong results, or a causality leak.
    fail-stop: ranks raised a clear error, or died. hang: the case deadline passed. diverged: a rank
    returned a tensor of the wrong shape (or, under benign faults, different bits). invalid: a
    scheduled fault never fired, so the run tested nothing.
    """

    PASS = "pass"
    SILENT_CORRUPTION = "silent-corruption"
    FAIL_STOP = "fail-stop"
    HANG = "hang"
    DIVERGED = "diverged"
    INVALID = "invalid"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


VERDICTS = tuple(v.value for v in Verdict)


@dataclass
class TensorCheck:
    """One tensor on one rank: worst error, allowed bound, ratio, where the worst error sits."""

    tensor: str
    rank: int
    error: float
    allowed: float
    nonfinite: int
    position: dict  # {"batch", "token" (global), "head"} of the worst error
    passed: bool
    # "NaN", "+inf", "-inf" (comma list) when `nonfinite` values came back
    nonfinite_kinds: str = ""
    # a narrower dtype every value lies on (precision lost on the way: judge.coarse_grid)
    grid: str = ""
    grid_values: int = 0  # how many nonzero values were looked at for `grid`

    @property
    def ratio(self) -> float:
        return float("inf") if self.nonfinite else self.error / self.allowed

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


@dataclass
class LeakCheck:
    """Keys that no query of S may see must get dk = dv = 0 exactly."""

    queries: list[int]
    hidden_keys: int
    leaks: list[dict] = field(default_factory=list)  # {"rank", "tensor", "token", "count"}

    @property
    def passed(self) -> bool:
        return not self.leaks


@dataclass
class CaseResult:
    """The outcome of one case: verdict, per-rank/per-tensor checks, errors, stacks, hashes,
    timings."""

    case: Case
    impl: str
    verdict: Verdict
    detail: str = ""
    checks: list[TensorCheck] = field(default_factory=list)
    leak: LeakCheck | None = None
    errors: dict[int, str] = field(default_factory=dict)  # group rank -> one-line error
    hung: dict[int, str] = field(default_factory=dict)  # group rank -> stack
    dead: dict[int, str] = field(default_factory=dict)  # group rank -> how it died
    hashes: dict[int, dict[str, str]] = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    # tensor -> (batch, token, head) abs error
    maps: dict[str, torch.Tensor] = field(default_factory=dict)
    # group rank -> outputs, with keep_shards
    shards: dict[int, dict[str, torch.Tensor]] | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASS

    def worst(self, tensor: str) -> float | None:
        """Worst error ratio (error / allowed) of a tensor over all ranks; None if not checked."""
        r = [c.ratio for c in self.checks if c.tensor == tensor]
        return max(r) if r else None

    def failed_checks(self) -> list[TensorCheck]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {
            "case": case_mod.to_dict(self.case),
            "summary": self.case.summary(),
            "impl": self.impl,
            "verdict": str(self.verdict),
            "detail": self.detail,
            "worst_ratio": {t: self.worst(t) for t in TENSORS if self.worst(t) is not None},
            "checks": [c.to_dict() for c in self.checks],
            "leak": None
            if self.leak is None
            else {
                "queries": self.leak.queries,
                "hidden_keys": self.leak.hidden_keys,
                "leaks": self.leak.leaks,
                "passed": self.leak.passed,
            },
            "errors": self.errors,
            "hung": self.hung,
            "dead": self.dead,
            "hashes": self.hashes,
            "timings": self.timings,
            **({"extra": self.extra} if self.extra else {}),
        }


def harness_version() -> str:
    try:
        return metadata.version("ring-harness")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def cpu_platform() -> str:
    """The CPU the ranks' kernels are picked for: architecture, vendor and torch's CPU capability.

    MKL and ATen choose kernels by the CPU. Two machines that differ here can round differently, so
    output hashes are compared bit for bit only between records of the same torch and platform
    (docs/cases.md: measured on an Intel and an earlier machine)."""
    vendor = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            vendor = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), ""
            )
    except OSError:
        pass
    vendor = vendor or platform.processor() or "unknown"
    return f"{platform.machine()} {vendor} {torch.backends.cpu.get_cpu_capability()}"


def result_record(r: CaseResult, impl_version: str = "unknown", backend: str = "gloo") -> dict:
    """The `result:` block of a case file."""
    versions = {
        "torch": str(torch.__version__),
        "ring-harness": harness_version(),
        "impl": impl_version,
        "python": platform.python_version(),
        "platform": cpu_platform(),
    }
    if r.extra.get("kernel"):  # the flash-attn kernel the ranks used, e.g. "cpu-standin"
        versions["kernel"] = r.extra["kernel"]
    return {
        "verdict": str(r.verdict),
        "detail": r.detail,
        "versions": versions,
        "backend": backend,
        "checks": [
            {
                "tensor": c.tensor,
                "rank": c.rank,
                "error": float(c.error),
                "allowed": float(c.allowed),
                "ratio": float(c.ratio) if c.ratio != float("inf") else "inf",
                "position": c.position,
            }
            for c in r.checks
        ],
        "leak": None if r.leak is None else {"queries": r.leak.queries, "leaks": r.leak.leaks},
        "errors": {int(k): v for k, v in r.errors.items()},
        "hashes": {int(k): dict(v) for k, v in r.hashes.items()},
    }


def failure_path(directory: str | os.PathLike, r: CaseResult, name: str | None = None) -> Path:
    stem = name or f"{r.impl.replace(':', '_').replace('/', '_')}-{r.verdict}-{r.case.key()}"
    return Path(directory) / f"{stem}.yaml"


def save_result(
    r: CaseResult,
    directory: str | os.PathLike,
    *,
    name: str | None = None,
    note: str | None = None,
    impl_version: str = "unknown",
    backend: str = "gloo",
    extra: dict | None = None,
) -> Path:
    """Write the case and its recorded result (plus `extra` keys, e.g. its localisation) atomically;
    returns the path."""
    text_note = note or f"{r.verdict}: {r.case.summary()}\n{r.detail}"
    rec = result_record(r, impl_version, backend)
    rec.update(extra or {})
    return case_mod.save(r.case, failure_path(directory, r, name), result=rec, note=text_note)
