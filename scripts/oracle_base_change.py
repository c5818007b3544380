"""How a change of the oracle (issue #12: onto the ranks, then split by rows and by keys) changed
what judging allows: for every case of the battery (and the medium cases), the tolerance bound of
each tensor with the oracle of a git revision before the change against the current oracle, and the
largest difference of the exact (float64) outputs. The old oracle is loaded from `git show`: its
`harness/judging/oracle.py` and `harness/ranks/reference.py` for a revision before the oracle had
its own package, else its `harness/oracle/` modules (OLD_LAYOUT, PACKAGE).

    python scripts/oracle_base_change.py [--rev 183d356]
    python scripts/oracle_base_change.py --whole   # issue #55: one pass against the shares

`--whole` compares today's two ways of computing a small training case's oracle, without git:
share by share (`assemble.local`, the ranks' bits) as "old", in one pass (`assemble.whole`, what
`--oracle auto` computes for a small case on CPU ranks) as "new".

The exact outputs move by float64 rounding only (other tiles and sum order). The base (the case's
dtype) rounds where plain attention under autograd rounds (docs/oracle.md), now in tiles of queries
x keys, so its error moves by which elements happen to round the other way: `bound new/old` below 1
is tighter, above 1 looser.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from harness import inputs
from harness.bench.overhead import medium_cases
from harness.dtypes import TORCH_DTYPES
from harness.judging import tolerance
from harness.judging.tensor_checks import _diff, _finite_max
from harness.oracle import assemble
from harness.search.battery import default_battery

TENSORS = ("out", "lse", "dq", "dk", "dv")
# (share code, assembly) of a revision before the oracle had its own package
OLD_LAYOUT = ("harness/ranks/reference.py", "harness/judging/oracle.py")
# the oracle's package since then: the modules `attention` needs, each after those it imports
PACKAGE = "harness/oracle"
PACKAGE_MODULES = ("tiles", "numerics", "shares", "assemble")


def _load(name: str, text: str):
    d = tempfile.mkdtemp()
    path = Path(d) / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _show(rev: str, path: str) -> str | None:
    got = subprocess.run(
        ["git", "show", f"{rev}:{path}"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return got.stdout if got.returncode == 0 else None


def _old_oracle(rev: str):
    """The oracle of `rev` as a module with `attention`: its assembly module, importing that
    revision's share code instead of today's."""
    if _show(rev, f"{PACKAGE}/assemble.py") is not None:
        return _old_package(rev)
    return _old_layout(rev)


def _old_layout(rev: str):
    """`harness/judging/oracle.py` of `rev`, importing that revision's `harness/ranks/reference.py`
    (its share code, where it has one)."""
    shares_path, oracle_path = OLD_LAYOUT
    shares = _show(rev, shares_path)
    import harness.ranks as ranks_pkg

    saved = sys.modules.get("harness.ranks.reference")
    saved_attr = getattr(ranks_pkg, "reference", None)
    try:
        if shares is not None:
            old = _load("old_reference", shares)
            sys.modules["harness.ranks.reference"] = old
            ranks_pkg.reference = old
        mod = _load("old_oracle", _show(rev, oracle_path))
    finally:
        _restore(sys.modules, "harness.ranks.reference", saved)
        _restore(vars(ranks_pkg), "reference", saved_attr)
    return mod


def _old_package(rev: str):
    """`harness/oracle/assemble.py` of `rev`, importing that revision's other modules of the
    package."""
    import harness.oracle as pkg

    names = [f"harness.oracle.{m}" for m in PACKAGE_MODULES]
    saved = {n: sys.modules.get(n) for n in names}
    saved_attrs = {m: getattr(pkg, m, None) for m in PACKAGE_MODULES}
    try:
        for m, name in zip(PACKAGE_MODULES, names, strict=True):
            text = _show(rev, f"{PACKAGE}/{m}.py")
            if text is None:  # a revision without this module
                continue
            mod = _load(f"old_oracle_{m}", text)
            sys.modules[name] = mod
            setattr(pkg, m, mod)
    finally:
        for name, old in saved.items():
            _restore(sys.modules, name, old)
        for m, old in saved_attrs.items():
            _restore(vars(pkg), m, old)
    return mod


def _restore(where: dict, name: str, saved) -> None:
    """Put back what `where[name]` held (nothing: remove it)."""
    if saved is None:
        where.pop(name, None)
    else:
        where[name] = saved


def _bounds(case, exact, base) -> dict[str, float]:
    """Each tensor's bound as `harness.judging.tensor_checks.check_tensors` computes it (finite
    maxima, -inf == -inf)."""
    lse_max = _finite_max(exact.lse)
    out = {}
    for name in TENSORS:
        r64 = getattr(exact, name)
        err = float(
            _diff(getattr(base, name).to(torch.float64), r64).nan_to_num(nan=float("inf")).max()
        )
        out[name] = tolerance.bound(
            name,
            case.dtype,
            err,
            _finite_max(r64),
            case.tolerance,
            case.world_size,
            lse_max,
            exact.term_scale.get(name, 0.0),
            exact.term_scale.get("blocks", {}).get("max_v", 0.0),
            case.sinks is not None,
        )
    return out


def _exact_moved(new, old) -> float:
    """The largest |new - old| / max|old| of the exact outputs over every tensor."""
    worst = 0.0
    for t in TENSORS:
        x, y = getattr(new, t), getattr(old, t)
        fin = torch.isfinite(y)
        if fin.any():
            worst = max(worst, float(((x - y).abs()[fin] / y.abs().max()).max()))
    return worst


def _whole() -> int:
    """Every small battery case `whole` computes, then the battery lengthened to the sizes one pass
    took over from the ranks: their bounds in one pass against share by share."""
    from harness.oracle.mode import small_oracle

    small = [c for c in default_battery(4) if small_oracle(c) and assemble.whole_ok(c)]
    for cases, what in ((small, "small battery cases"), (_mid_cases(), "lengthened cases")):
        ratios: dict[str, list[float]] = {t: [] for t in TENSORS}
        worst_exact = 0.0
        for c in cases:
            (oexact, obase), (nexact, nbase) = assemble.local(c), assemble.whole(c)
            worst_exact = max(worst_exact, _exact_moved(nexact, oexact))
            bo, bn = _bounds(c, oexact, obase), _bounds(c, nexact, nbase)
            for t in TENSORS:
                ratios[t].append(bn[t] / bo[t])
        print(f"{len(cases)} {what} without sinks: one pass (new) against the shares (old)")
        _report(worst_exact, ratios)
    return 0


# SMALL_ORACLE before the kept tiles (#55): larger cases were the ranks'
OLD_SMALL_ORACLE = 2**23


def _mid_cases() -> list:
    """The battery's training cases without sinks, each lengthened by the smallest whole factor
    that takes its oracle past OLD_SMALL_ORACLE, kept if one pass still computes it."""
    from harness.oracle.mode import small_oracle

    out = []
    for c in default_battery(4):
        if not assemble.whole_ok(c):
            continue
        work = c.batch * c.heads_q * max(c.head_dim, c.dim_v) * c.total_len**2
        f = math.isqrt(OLD_SMALL_ORACLE // work) + 1
        while work * f * f <= OLD_SMALL_ORACLE:
            f += 1
        longer = c.replace(seq_lens=tuple(n * f for n in c.seq_lens))
        if small_oracle(longer):
            out.append(longer)
    return out


def _report(worst_exact: float, ratios: dict[str, list[float]]) -> None:
    print(
        "exact (float64) outputs: largest |new - old| / max|old| over every tensor and case: "
        f"{worst_exact:.2e}"
    )
    print("tolerance bound new / old per tensor: min, median, max")
    for t in TENSORS:
        r = sorted(ratios[t])
        print(f"  {t:4s} {r[0]:.3f}  {r[len(r) // 2]:.3f}  {r[-1]:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rev",
        default="183d356",
        help="the revision to compare with (183d356: the "
        "row shares, before "
        "the two passes; a751728~1: the single-process oracle)",
    )
    p.add_argument(
        "--medium", type=int, default=2, help="also this many medium cases (W=4, L=2048)"
    )
    p.add_argument("--whole", action="store_true", help="one pass against the shares (#55)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.whole:
        return _whole()
    old = _old_oracle(a.rev)
    cases = default_battery(4) + medium_cases(a.medium, 2048)
    ratios: dict[str, list[float]] = {t: [] for t in TENSORS}
    worst_exact, skipped = 0.0, 0
    for c in cases:
        g = inputs.make_global(c)
        args = (g["q"], g["k"], g["v"], g["dout"], c.mask, c.scale)
        oexact = old.attention(*args, compute=torch.float64)
        obase = old.attention(*args, compute=TORCH_DTYPES[c.dtype])
        nexact, nbase = assemble.local(c)
        worst_exact = max(worst_exact, _exact_moved(nexact, oexact))
        bo, bn = _bounds(c, oexact, obase), _bounds(c, nexact, nbase)
        # an oracle older than #16: NaN on rows that see no key
        if not all(map(math.isfinite, bo.values())):
            skipped += 1
            continue
        for t in TENSORS:
            ratios[t].append(bn[t] / bo[t])
    print(
        f"{len(cases)} cases (the W=4 battery + {a.medium} medium); old oracle: {a.rev}; "
        f"{skipped} skipped "
        "(rows that see no key: the old oracle's bounds were not finite)"
    )
    _report(worst_exact, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
