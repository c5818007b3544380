"""How a change of the oracle (issue #12: onto the ranks, then split by rows and by keys) changed what judging
allows: for every case of the battery (and the medium cases), the tolerance bound of each tensor with the oracle of
a git revision before the change (its `harness/judging/oracle.py` and `harness/ranks/reference.py`, loaded from
`git show`) against the current oracle, and the largest difference of the float64 references.

    python scripts/oracle_base_change.py [--rev 183d356]

The float64 reference moves by float64 rounding only (other tiles and sum order). The base (the case's dtype)
rounds where plain attention under autograd rounds (harness.ranks.reference's docstring), now in tiles of queries
x keys, so its error moves by which elements happen to round the other way: `bound new/old` below 1 is tighter,
above 1 looser.
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
from harness.judging import oracle, tolerance
from harness.judging.judge import _diff, _finite_max
from harness.search.battery import default_battery

TENSORS = ("out", "lse", "dq", "dk", "dv")


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
    got = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    return got.stdout if got.returncode == 0 else None


def _old_oracle(rev: str):
    """`harness/judging/oracle.py` of `rev`, importing that revision's `harness/ranks/reference.py` (its share
    code, where it has one) instead of today's."""
    shares = _show(rev, "harness/ranks/reference.py")
    saved = sys.modules.get("harness.ranks.reference")
    try:
        if shares is not None:
            old = _load("old_reference", shares)
            sys.modules["harness.ranks.reference"] = old
            import harness.ranks as ranks_pkg

            saved_attr, ranks_pkg.reference = getattr(ranks_pkg, "reference", None), old
        mod = _load("old_oracle", _show(rev, "harness/judging/oracle.py"))
    finally:
        if saved is not None:
            sys.modules["harness.ranks.reference"] = saved
        if shares is not None:
            ranks_pkg.reference = saved_attr
    return mod


def _bounds(case, ref, base) -> dict[str, float]:
    """Each tensor's bound as `harness.judging.judge.check_tensors` computes it (finite maxima, -inf == -inf)."""
    lse_max = _finite_max(ref.lse)
    out = {}
    for name in TENSORS:
        r64 = getattr(ref, name)
        err = float(_diff(getattr(base, name).to(torch.float64), r64).nan_to_num(nan=float("inf")).max())
        out[name] = tolerance.bound(name, case.dtype, err, _finite_max(r64), case.tolerance, case.world_size,
                                    lse_max, ref.term_scale.get(name, 0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="183d356", help="the revision to compare with (183d356: the row shares, before "
                   "the two passes; a751728~1: the single-process oracle)")
    p.add_argument("--medium", type=int, default=2, help="also this many medium cases (W=4, L=2048)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    old = _old_oracle(a.rev)
    cases = default_battery(4) + medium_cases(a.medium, 2048)
    ratios: dict[str, list[float]] = {t: [] for t in TENSORS}
    worst_ref, skipped = 0.0, 0
    for c in cases:
        g = inputs.make_global(c)
        args = (g["q"], g["k"], g["v"], g["dout"], c.mask, c.scale)
        oref, obase = old.attention(*args, compute=torch.float64), old.attention(*args, compute=TORCH_DTYPES[c.dtype])
        nref, nbase = oracle.local(c)
        for t in TENSORS:
            x, y = getattr(nref, t), getattr(oref, t)
            fin = torch.isfinite(y)
            if fin.any():
                worst_ref = max(worst_ref, float(((x - y).abs()[fin] / y.abs().max()).max()))
        bo, bn = _bounds(c, oref, obase), _bounds(c, nref, nbase)
        if not all(map(math.isfinite, bo.values())):  # an oracle older than #16: NaN on rows that see no key
            skipped += 1
            continue
        for t in TENSORS:
            ratios[t].append(bn[t] / bo[t])
    print(f"{len(cases)} cases (the W=4 battery + {a.medium} medium); old oracle: {a.rev}; {skipped} skipped "
          "(rows that see no key: the old oracle's bounds were not finite)")
    print(f"float64 reference: largest |new - old| / max|old| over every tensor and case: {worst_ref:.2e}")
    print("tolerance bound new / old per tensor: min, median, max")
    for t in TENSORS:
        r = sorted(ratios[t])
        print(f"  {t:4s} {r[0]:.3f}  {r[len(r) // 2]:.3f}  {r[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
