"""The growth check: a metamorphic check on ring size.

The same global case (seed, total length, mask, dtype, shape) runs at W = 1 and at W = 2, 4, 8 on
the same implementation. A correct ring's error does not grow with W beyond the float32 merge
roundings. A ring that rounds a running result to the input dtype once per ring step does: the
out/lse merge, dq, or the dk/dv that travel. Per tensor, the RMS error at W = 4 and 8 is divided by
the larger of the errors at W = 1 and 2. The case fails above GROWTH_LIMIT. docs/tolerance.md has
the statistic, why it is sound, and the measurements.

Only fp16 and bf16 cases run: rounding to the input dtype is exact for fp32 inputs. A run that does
not complete, returns non-finite values or fails on its own gives no figure. It ends the growth
check, and the battery reports it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from harness.calls import needs_backward
from harness.case import Case, make_case
from harness.checks.options import CheckOptions
from harness.context import Capabilities
from harness.impls.capabilities import divisible_heads
from harness.judging import tolerance
from harness.oracle import cache
from harness.result import CaseResult, Verdict
from harness.runner import run_case
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec

if TYPE_CHECKING:
    from harness.checks.check import Check

name = "growth"  # the stage's name (harness.checks.stages.Stage)
# Between the correct rings' x1.12 and the per-step mutants' >= x1.61 at W = 8.
GROWTH_LIMIT = 1.4
WORLD_SIZES = (1, 2, 4, 8)
TENSORS = ("out", "dq", "dk", "dv")
# Divisible by 2W for every W here: even shards in every layout.
TOTAL_LEN = 64
SHAPE = {"batch": 1, "heads_q": 2, "heads_kv": 2, "head_dim": 32}
SEEDS = {"none": 9101, "causal": 9102}


@dataclass
class GrowthCase:
    """One global case at several ring sizes: RMS error per W and tensor, and the growth figures."""

    label: str  # dtype, layout, mask, shape
    cases: dict[int, Case] = field(default_factory=dict)
    results: dict[int, CaseResult] = field(default_factory=dict)
    rms: dict[int, dict[str, float]] = field(default_factory=dict)  # W -> tensor -> e_t(W)
    growth: dict[int, dict[str, float]] = field(default_factory=dict)  # W -> tensor -> g_t(W)
    note: str = ""  # why there is no figure

    @property
    def worst(self) -> tuple[int, str, float] | None:
        """(W, tensor, g) of the largest growth figure."""
        cells = [(w, t, g) for w, per in self.growth.items() for t, g in per.items()]
        return max(cells, key=lambda c: c[2]) if cells else None

    @property
    def passed(self) -> bool:
        w = self.worst
        return w is None or w[2] <= GROWTH_LIMIT

    @property
    def detail(self) -> str:
        """One line, e.g. 'out error x2.09 at W8 over W1/W2 (limit x1.4): bf16 contiguous none h2
        d32 L64'.
        """
        w = self.worst
        if w is None:
            return f"{self.note or 'no figure'}: {self.label}"
        return f"{w[1]} error x{w[2]:.2f} at W{w[0]} over W1/W2 (limit x{GROWTH_LIMIT:g}): {self.label}"


@dataclass
class GrowthOutcome:
    """What the growth check ran: per case the errors per W and the figures; and `passed`."""

    impl: str
    cases: list[GrowthCase] = field(default_factory=list)
    world_sizes: tuple[int, ...] = ()
    limit: float = GROWTH_LIMIT
    skipped: str = ""  # why nothing ran
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[GrowthCase]:
        return [c for c in self.cases if not c.passed]

    def to_dict(self) -> dict:
        return {
            "impl": self.impl,
            "passed": self.passed,
            "limit": self.limit,
            "skipped": self.skipped,
            "world_sizes": list(self.world_sizes),
            "seconds": self.seconds,
            "cases": [
                {
                    "label": c.label,
                    "rms": {str(w): v for w, v in c.rms.items()},
                    "growth": {str(w): v for w, v in c.growth.items()},
                    "note": c.note,
                    "passed": c.passed,
                    "verdicts": {str(w): r.verdict for w, r in c.results.items()},
                    "worst": list(c.worst) if c.worst else None,
                }
                for c in self.cases
            ],
        }


def plan(
    caps: Capabilities, pool_size: int, dtype: str | None = None, impl: str = "reference"
) -> tuple[tuple[int, ...], list[dict[int, Case]]]:
    """(ring sizes, [{W: case}]) for an implementation's declared capabilities. Empty when none
    apply.
    """
    lo, hi = caps.world_sizes
    worlds = tuple(w for w in WORLD_SIZES if lo <= w <= min(hi, pool_size))
    dtypes = [d for d in ("bf16", "fp16") if d in caps.dtypes and (dtype is None or d == dtype)]
    layout = "contiguous" if "contiguous" in caps.layouts else sorted(caps.layouts)[0]
    masks = [m for m in ("none", "causal") if m in caps.masks]
    head_dim = SHAPE["head_dim"]
    if caps.head_dims is not None and head_dim not in caps.head_dims:
        head_dim = min(caps.head_dims, key=lambda d: abs(d - SHAPE["head_dim"]))
    if len(worlds) < 2 or not dtypes or not masks:
        return worlds, []
    heads = {"heads_q": SHAPE["heads_q"], "heads_kv": SHAPE["heads_kv"]}
    # e.g. Ulysses: one head count every ring size divides (8/8 at W <= 8)
    if caps.heads_divisible_by_world:
        heads["heads_q"], heads["heads_kv"] = divisible_heads(
            heads["heads_q"], heads["heads_kv"], max(worlds)
        )
    # a forward-only ring: the growth of out's (and lse's) error
    call = "train" if caps.backward else "no-grad"
    out = []
    for dt in dtypes:
        for m in masks:
            out.append(
                {
                    w: make_case(
                        world_size=w,
                        total_len=TOTAL_LEN,
                        layout=layout,
                        mask=MaskSpec(m),
                        dtype=dt,
                        seed=SEEDS[m],
                        impl=impl,
                        call=call,
                        **{**SHAPE, **heads, "head_dim": head_dim},
                    )
                    for w in worlds
                }
            )
    return worlds, out


def rms_errors(r: CaseResult) -> dict[str, float] | None:
    """e_t = RMS of (impl - exact) over every element of every rank, per tensor.

    None when the run has no usable outputs. The oracle's exact outputs come from the cache: the run
    just computed them.
    """
    if not r.shards or r.verdict not in (Verdict.PASS, Verdict.SILENT_CORRUPTION):
        return None
    exact = cache.outputs(r.case)[0]
    pos = all_positions(r.case.layout, r.case.seq_lens)
    out = {}
    for t in TENSORS:
        sq, n = 0.0, 0
        for rank, shard in sorted(r.shards.items()):  # one order: the replies arrive in any
            if t not in shard:
                break
            d = shard[t].to(torch.float64) - getattr(exact, t).index_select(1, pos[rank])
            if not bool(torch.isfinite(d).all()):
                return None
            sq, n = sq + float((d * d).sum()), n + d.numel()
        else:
            if n:
                out[t] = math.sqrt(sq / n)
    return out


def baseline_sizes(worlds) -> tuple[int, ...]:
    """The ring sizes whose larger error is the baseline: W = 1 and 2, or W = 1 alone if nothing
    exceeds 2.
    """
    worlds = sorted(worlds)
    base = tuple(w for w in worlds if w <= 2) or tuple(worlds[:1])
    return base if any(w > max(base) for w in worlds) else tuple(worlds[:1])


def _figures(gc: GrowthCase) -> None:
    base_ws = baseline_sizes(gc.rms)
    w0 = max(base_ws)
    scales = cache.outputs(gc.cases[w0])[0].term_scale
    for w in sorted(gc.rms):
        if w <= w0:
            continue
        per = {}
        for t, e in gc.rms[w].items():
            if any(t not in gc.rms[b] for b in base_ws):
                continue
            base = max(gc.rms[b][t] for b in base_ws)
            fp32 = (w - w0) * tolerance.unit("fp32") * max(scales.get(t, {}).values(), default=0.0)
            per[t] = e / (base + fp32 + 1e-300)
        gc.growth[w] = per


def _line(gc: GrowthCase, worlds: tuple[int, ...]) -> str:
    cells = []
    for w in [w for w in worlds if w > max(baseline_sizes(worlds))]:
        per = gc.growth.get(w)
        if per:
            t = max(per, key=per.get)
            cells.append(f"W{w} x{per[t]:.2f} ({t})")
        else:
            cells.append(f"W{w}    -   ")
    status = gc.note or (
        "pass" if gc.passed else f"FAIL: error grows with W (limit x{GROWTH_LIMIT:g})"
    )
    return f"    {gc.label:<34} " + "  ".join(cells) + f"  {status}"


def growth_check(
    pool,
    opts: CheckOptions,
    caps: Capabilities,
    reporter,
    planned: tuple[tuple[int, ...], list[dict[int, Case]]] | None = None,
) -> GrowthOutcome:
    """Run the growth check of `opts.impl` on `pool`. Lines go to `reporter`.

    `planned` is (ring sizes, [{W: case}]) to run instead of `plan`'s: the user's shape, from
    harness.checks.stages.shape.
    """
    start = time.perf_counter()
    res = GrowthOutcome(impl=opts.impl)
    size = pool.capacity
    worlds, plans = planned if planned is not None else plan(caps, size, opts.dtype, opts.impl)
    res.world_sizes = worlds
    if not plans:
        res.skipped = (
            "needs fp16 or bf16 (rounding to fp32 is exact)"
            if len(worlds) >= 2
            else f"needs two ring sizes of {WORLD_SIZES} (declared {caps.world_sizes}, pool {size})"
        )
        reporter(f"growth check: skipped ({res.skipped})")
        return res
    judged = (
        "out/dq/dk/dv" if needs_backward(plans[0][worlds[0]].call) else "out (a forward-only ring)"
    )
    reporter(
        f"growth check: {len(plans)} global cases at W = {', '.join(map(str, worlds))}; RMS "
        "error of "
        f"{judged} at W over the larger of W = {', '.join(map(str, baseline_sizes(worlds)))} "
        f"must stay <= x{GROWTH_LIMIT:g}"
    )
    for cases in plans:
        c0 = cases[worlds[0]]
        gc = GrowthCase(
            label=f"{c0.dtype} {c0.layout} {c0.mask.kind} h{c0.heads_q} d{c0.head_dim} "
            f"L{c0.total_len}",
            cases=cases,
        )
        for w, c in cases.items():
            # --deadline holds for every stage's runs
            if opts.deadline is not None and planned is None:
                c = cases[w] = c.replace(deadline_s=opts.deadline)
            r = run_case(
                c, pool, opts.impl, allow_import=opts.allow_import, leak=False, keep_shards=True
            )
            e = rms_errors(r)
            r.shards = None  # large: keep only the figures
            gc.results[w] = r
            # no figure (or none that means anything: a wrong run)
            if e is None or r.verdict != Verdict.PASS:
                gc.note = f"no figure: W{w} ended {r.verdict}"
                break
            gc.rms[w] = e
        if not gc.note:
            _figures(gc)
        res.cases.append(gc)
        reporter(_line(gc, worlds))
        # A run was wrong, hung or raised on its own: the battery says what failed, and how.
        if gc.note:
            res.skipped = f"stopped after {gc.label}: {gc.note} (the other stages report why)"
            reporter(f"growth check: {res.skipped}")
            break
    res.seconds = time.perf_counter() - start
    worst = max(
        (c.worst + (c.label,) for c in res.cases if c.worst), key=lambda x: x[2], default=None
    )
    figures = any(c.worst for c in res.cases)
    verdict = "pass" if figures else "no figure (runs did not complete)"
    if res.skipped:
        # a run failed on its own: the growth figures that came before it are no verdict
        verdict = "stopped, no verdict (a run failed on its own: see the failure groups)"
    if not res.passed:
        verdict = f"FAIL ({len(res.failures)} case(s))"
    figure = f"; worst x{worst[2]:.2f} ({worst[1]} at W{worst[0]}, {worst[3]})" if worst else ""
    reporter(f"growth check: {verdict}{figure}  [{res.seconds:.1f} s]")
    return res


# -- the stage -------------------------------------------------------------------------------------


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """Ranks the growth check asks for: its largest declared ring size. 0 when off."""
    if not opts.growth:
        return 0
    lo, hi = caps.world_sizes
    return max((w for w in WORLD_SIZES if lo <= w <= hi), default=0)


def record_failures(check: Check, g: GrowthOutcome) -> bool:
    """Record each failing global case on `check`, with its worst ring size's run as the result.

    That run passes on its own. The failure is the figure, kept in `Failure.growth`. True: stop.
    """
    for gc in g.failures:
        check.reporter(f"        -> {gc.detail}")
        if check.record_failure(name, gc.results[gc.worst[0]], grown=gc):
            return True
    return False


def run(check: Check) -> bool:
    """Run the growth check into `check.outcome`. True: the check stops at one of its failures."""
    outcome = check.outcome
    if not check.opts.growth:
        return False
    outcome.growth = g = growth_check(check.pool, check.opts, check.caps, check.reporter)
    outcome.cases += sum(len(c.results) for c in g.cases)
    # A growth run that hung cost its deadline like any other: it counts toward --max-hangs.
    # The growth check stops at it and records no failure. The battery's runs say what is wrong,
    # and stop at the limit.
    outcome.hangs += sum(r.verdict == Verdict.HANG for c in g.cases for r in c.results.values())
    if record_failures(check, g):
        return check.stop(f"stopped at the growth check ({len(outcome.failures)} failing)")
    return False
