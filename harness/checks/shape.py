"""The user's own shape (`check --shape b1,hq32,hkv8,d128,L8192,W8`): the layout x mask x dtype
basics and the growth check at exactly that shape, after an up-front estimate of their time and
memory on this machine.

A shape the implementation does not declare (its world size, heads, head_dim, an uneven split) is
refused in one line; a layout, mask or dtype it does not declare is left out of the basics, and the
plan says so. A plan whose memory does not fit, or whose time exceeds `CheckOptions.shape_budget`,
is refused with the estimate before any rank starts. The time model and its calibration:
docs/benchmarks.md (figure 7).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field

from harness import limits
from harness.case import Case, make_case
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.impls.capabilities import feature_words, missing_features
from ring_impl.layouts import LAYOUTS, split_lengths
from ring_impl.masks import MaskSpec

SEED = 2950
MAX_TOKENS = 1 << 22
DTYPES = ("bf16", "fp16", "fp32")
# flops per b x hq x max(d, WORK_DIM) x L^2 (summed over ranks): the ring's forward + backward and
# its leak run (2 x 14), and the oracle's two passes (harness.oracle.mode.ORACLE_PASS_FLOPS: 32 +
# 20), with the elementwise work
RING_FLOPS = 28.0
ORACLE_FLOPS = 52.0
WORK_DIM = 32
OVERHEAD_S = 0.3  # per run: messages, shards, judging
# measured / modelled seconds of shapes of 1k-4k tokens on 2 cores (docs/benchmarks.md, figure 8)
SLACK = 1.4
_KEYS = {
    "b": "batch",
    "hq": "heads_q",
    "hkv": "heads_kv",
    "h": "heads",
    "d": "head_dim",
    "l": "total_len",
    "w": "world_size",
}


@dataclass(frozen=True)
class Shape:
    """A training shape: batch, query and kv heads, head_dim, the global sequence length and the
    ring size."""

    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    total_len: int
    world_size: int

    def spec(self) -> str:
        return (
            f"b{self.batch},hq{self.heads_q},hkv{self.heads_kv},d{self.head_dim},L{self.total_len},"
            f"W{self.world_size}"
        )

    def case(self, **kw) -> Case:
        """A case of this shape (an even split of L over W)."""
        return make_case(
            world_size=self.world_size,
            total_len=self.total_len,
            batch=self.batch,
            heads_q=self.heads_q,
            heads_kv=self.heads_kv,
            head_dim=self.head_dim,
            **kw,
        )


def parse_shape(text: str | Shape) -> Shape:
    """`b1,hq32,hkv8,d128,L8192,W8` (b defaults to 1, hkv to hq; `h16` sets both) -> Shape; one line
    otherwise."""
    if isinstance(text, Shape):
        return text
    usage = "expected e.g. b1,hq32,hkv8,d128,L8192,W8 (batch, query heads, kv heads, head_dim, tokens, ranks)"
    if not isinstance(text, str) or not text.strip():
        raise HarnessError(f"--shape: {usage}")
    got: dict[str, int] = {}
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"([a-zA-Z]+)(\d+)", part)
        key = _KEYS.get(m.group(1).lower()) if m else None
        if key is None:
            raise HarnessError(f"--shape: cannot read {part!r}; {usage}")
        if key in got:
            raise HarnessError(f"--shape: {part!r} given twice; {usage}")
        got[key] = int(m.group(2))
    if "heads" in got:
        got.setdefault("heads_q", got["heads"])
        got.setdefault("heads_kv", got.pop("heads"))
    missing = [k for k in ("heads_q", "head_dim", "total_len", "world_size") if k not in got]
    if missing:
        names = {"heads_q": "hq", "head_dim": "d", "total_len": "L", "world_size": "W"}
        raise HarnessError(f"--shape: missing {', '.join(names[k] for k in missing)}; {usage}")
    got.setdefault("batch", 1)
    got.setdefault("heads_kv", got["heads_q"])
    s = Shape(**got)
    for k, v in got.items():
        if k != "total_len" and not limits.CASE[k].holds(v):
            raise HarnessError(f"--shape: {k} must be {limits.CASE[k].words()}, got {v}")
    if s.heads_q % s.heads_kv:
        raise HarnessError(f"--shape: hq ({s.heads_q}) must be a multiple of hkv ({s.heads_kv})")
    if s.world_size > 64 or s.total_len < s.world_size or s.total_len > MAX_TOKENS:
        raise HarnessError(
            f"--shape: needs 1 <= W <= 64 and W <= L <= {MAX_TOKENS}, got "
            f"W{s.world_size} "
            f"L{s.total_len}"
        )
    return s


@dataclass
class ShapePlan:
    """What `--shape` runs: the basics and the growth check's global cases ({W: case}), and what it
    left out."""

    shape: Shape
    basics: list[Case] = field(default_factory=list)
    growth: list[dict[int, Case]] = field(default_factory=list)
    growth_worlds: tuple[int, ...] = ()
    left_out: list[str] = field(default_factory=list)

    @property
    def runs(self) -> list[Case]:
        return self.basics + [c for g in self.growth for c in g.values()]


def _masks(shape: Shape) -> list[MaskSpec]:
    """none, causal, a window reaching half a rank's length back, documents straddling the ranks."""
    n, w = shape.total_len, shape.world_size
    starts = sorted({0, *(s for s in (n // 5, n // 2 + 1, n - 3) if 0 < s < n)})
    return [
        MaskSpec("none"),
        MaskSpec("causal"),
        MaskSpec("window", window=max(1, n // (2 * w))),
        MaskSpec("document", doc_starts=tuple(starts)),
    ]


def plan(
    shape: Shape,
    caps: Capabilities,
    impl: str = "reference",
    dtype: str | None = None,
    pool_size: int | None = None,
) -> ShapePlan:
    """The runs at `shape` that `caps` declares; a shape-level feature it does not declare is
    refused here."""
    lens = tuple(split_lengths(shape.total_len, shape.world_size))
    missing = _missing(
        caps, shape, lens, sorted(caps.layouts)[0], sorted(caps.masks)[0], sorted(caps.dtypes)[0]
    )
    if missing:
        words = "; ".join(
            feature_words(f, caps, heads_q=shape.heads_q, heads_kv=shape.heads_kv, lengths=lens)
            for f in missing
        )
        raise HarnessError(f"--shape {shape.spec()}: {impl} does not declare {words}")
    if pool_size is not None and shape.world_size > pool_size:
        raise HarnessError(
            f"--shape {shape.spec()}: needs {shape.world_size} ranks, {pool_size} started"
        )
    out = ShapePlan(shape)
    dtypes = [d for d in DTYPES if d in caps.dtypes and (dtype is None or d == dtype)]
    if not dtypes:
        raise HarnessError(f"--shape: {impl} does not declare dtype {dtype}")
    _add_basics(out, caps, impl, dtypes, lens)
    _add_growth(out, caps, impl, dtypes)
    return out


def _missing(
    caps: Capabilities,
    shape: Shape,
    lens: tuple[int, ...],
    layout: str,
    mask: MaskSpec | str,
    dtype: str,
) -> list[str]:
    """The features of one run at `shape` that `caps` does not declare."""
    return missing_features(
        caps,
        layout=layout,
        mask_kind=mask,
        dtype=dtype,
        world_size=shape.world_size,
        heads_q=shape.heads_q,
        heads_kv=shape.heads_kv,
        lengths=lens,
        head_dim=shape.head_dim,
        subgroup=False,
        device=None,
    )


def _add_basics(
    out: ShapePlan, caps: Capabilities, impl: str, dtypes: list[str], lens: tuple[int, ...]
) -> None:
    """Every declared layout x mask x dtype at the shape; the undeclared ones go to `left_out`."""
    shape = out.shape
    for layout in LAYOUTS:
        for mask in _masks(shape):
            for dt in dtypes:
                feats = _missing(caps, shape, lens, layout, mask, dt)
                if feats:
                    out.left_out.append(f"{layout} {mask.describe()} {dt} ({', '.join(feats)})")
                    continue
                out.basics.append(
                    shape.case(
                        layout=layout, mask=mask, dtype=dt, impl=impl, seed=SEED + len(out.basics)
                    )
                )


def _add_growth(out: ShapePlan, caps: Capabilities, impl: str, dtypes: list[str]) -> None:
    """The growth check's global cases at the declared ring sizes up to W (two sizes at least)."""
    shape = out.shape
    lo, hi = caps.world_sizes
    worlds = tuple(sorted({w for w in (1, 2, 4, 8) if w < shape.world_size} | {shape.world_size}))
    worlds = tuple(w for w in worlds if lo <= w <= hi and (caps.uneven or shape.total_len % w == 0))
    out.growth_worlds = worlds
    if len(worlds) < 2:
        return
    layout = "contiguous" if "contiguous" in caps.layouts else sorted(caps.layouts)[0]
    for dt in [d for d in ("bf16", "fp16") if d in dtypes]:
        for m in ("none", "causal"):
            if m not in caps.masks:
                continue
            out.growth.append(
                {
                    w: make_case(
                        world_size=w,
                        total_len=shape.total_len,
                        batch=shape.batch,
                        heads_q=shape.heads_q,
                        heads_kv=shape.heads_kv,
                        head_dim=shape.head_dim,
                        layout=layout,
                        mask=MaskSpec(m),
                        dtype=dt,
                        impl=impl,
                        seed=SEED + 100 + len(out.growth),
                    )
                    for w in worlds
                }
            )


# -- the estimate ----------------------------------------------------------------------------------


def _rate(dtype) -> float:
    """One thread's matmul rate here (flop/s), measured in ~0.1 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256, dtype=dtype)
        torch.mm(a, a)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            torch.mm(a, a)
            n += 1
        return 2 * 256**3 * n / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Rates:
    """One thread's float32 and float64 matmul rates (flop/s) and the cores."""

    fp32: float
    fp64: float
    cores: int

    @classmethod
    def measure(cls) -> Rates:
        import torch

        return cls(_rate(torch.float32), _rate(torch.float64), os.cpu_count() or 1)


def run_seconds(c: Case, rates: Rates) -> tuple[float, float]:
    """(ring seconds, oracle seconds) of one run of `c` on this machine: its work over the cores its
    ranks use."""
    work = c.batch * c.heads_q * max(c.head_dim, WORK_DIM) * c.total_len**2
    par = min(c.world_size, rates.cores)
    return (
        SLACK * RING_FLOPS * work / (rates.fp32 * par) + OVERHEAD_S,
        SLACK * ORACLE_FLOPS * work / (rates.fp64 * par),
    )


@dataclass(frozen=True)
class Estimate:
    """The plan's time and peak memory on this machine."""

    seconds: float
    slowest_s: float
    memory: object  # harness.ranks.oom.MemoryEstimate of the largest run

    def words(self) -> str:
        return (
            f"~{_duration(self.seconds)} (the slowest run ~{_duration(self.slowest_s)}), peak "
            "memory "
            f"{self.memory.words()}"
        )


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def estimate(p: ShapePlan, rates: Rates | None = None) -> Estimate:
    from harness.ranks import oom

    rates = rates or Rates.measure()
    times = [sum(run_seconds(c, rates)) for c in p.runs]
    biggest = max(p.runs, key=lambda c: oom.estimate(c).total) if p.runs else p.shape.case()
    return Estimate(sum(times), max(times, default=0.0), oom.estimate(biggest))


def deadline(c: Case, rates: Rates) -> float:
    """A run's deadline: 5x its modelled ring time, 60 s at least, the case format's 3600 s at
    most."""
    return min(3600.0, max(60.0, math.ceil(5 * run_seconds(c, rates)[0])))


def refuse_or_accept(p: ShapePlan, est: Estimate, budget_s: float, dtype: str | None) -> None:
    """Raise one HarnessError line when the plan cannot fit in memory or exceeds `budget_s`."""
    head = f"--shape {p.shape.spec()}: {len(p.basics)} basics + {len(p.runs) - len(p.basics)} growth-check runs"
    if not est.memory.fits:
        raise HarnessError(f"{head} do not fit this machine: {est.memory.words()}")
    if est.seconds > budget_s:
        hint = "" if dtype else " or --dtype bf16 (a third of the basics)"
        raise HarnessError(
            f"{head} would take {est.words()}; over --shape-budget {budget_s:g} s: "
            "pass a larger "
            f"--shape-budget{hint}"
        )
