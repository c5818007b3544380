"""The growth check's figures (issue #10): for the correct rings and every per-step-rounding mutant,
the RMS error per ring size W = 1, 2, 4, 8 of the worst tensor and the growth figure g(W) (error at
W over the larger of W = 1, 2, see harness/checks/stages/growth.py), per global case, as one table.

    python scripts/growth_figures.py
"""

from __future__ import annotations

from harness.checks.options import CheckOptions
from harness.checks.stages.growth import GROWTH_LIMIT, growth_check
from harness.context import Capabilities
from harness.ranks.pool import RankPool

IMPLS = (
    "reference",
    "flash-ring",
    "torch-ring",
    "mutant:out-merge-in-input-dtype",
    "mutant:dq-accumulate-in-input-dtype",
    "mutant:dkv-travel-in-input-dtype",
    "mutant:low-precision-accumulator",
)


def main() -> None:
    print(
        f"growth limit x{GROWTH_LIMIT:g}; g(W) = RMS error at W / max(RMS at W1, W2); worst "
        "tensor per cell; "
        "e(W) = RMS error of the tensor worst at W8"
    )
    print(
        f"{'implementation':<38} {'global case':<34} {'e(W1)':>9} {'e(W2)':>9} {'W2/W1':>6} "
        f"{'g(W4)':>12} "
        f"{'g(W8)':>12}  verdict"
    )
    with RankPool(8) as pool:
        for impl in IMPLS:
            res = growth_check(pool, CheckOptions(impl=impl), Capabilities(), lambda line: None)
            for gc in res.cases:
                if not gc.growth:
                    print(f"{impl:<38} {gc.label:<34} {gc.note}")
                    continue
                cells = []
                for w in (4, 8):
                    per = gc.growth.get(w, {})
                    t = max(per, key=per.get) if per else "-"
                    cells.append(f"x{per[t]:.2f} ({t})" if per else "-")
                worst8 = max(gc.growth[8], key=gc.growth[8].get)
                e1, e2 = gc.rms[1][worst8], gc.rms[2][worst8]
                g2 = e2 / e1  # W2 is part of the baseline: its figure against W1 alone
                print(
                    f"{impl:<38} {gc.label:<34} {e1:9.2e} {e2:9.2e} {g2:6.2f} {cells[0]:>12} "
                    f"{cells[1]:>12}  "
                    f"{'pass' if gc.passed else 'FAIL'}"
                )


if __name__ == "__main__":
    main()
