"""What the oracle's kept tiles (issue #55, `harness/oracle/tile_store.py`) save, and that they keep
every bit: each case's oracle with the store and with a store of no room, one thread.

    python scripts/oracle_kept_tiles.py [--rounds 3]

The cases: the battery's training cases, and the same lengthened past the old SMALL_ORACLE
(`oracle_base_change._mid_cases`). One pass (`assemble.whole`) for those without sinks, and share
by share (`assemble.local`, what each rank computes) for every one. Rounds interleave the two ways;
it prints each way's median seconds and their ratio, and fails if any output or term scale moved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from oracle_base_change import _mid_cases

from harness.oracle import assemble, tile_store
from harness.search.battery import default_battery

FIELDS = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _oracles(cases, budget: int) -> tuple[list, dict[str, float]]:
    """Every case's one-pass and shares' pairs with the store's budget, and seconds per way."""
    tile_store.BUDGET_BYTES = budget
    got, secs = [], {"whole": 0.0, "local": 0.0}
    for c in cases:
        t0 = time.perf_counter()
        w = assemble.whole(c) if assemble.whole_ok(c) else None
        t1 = time.perf_counter()
        got.append((w, assemble.local(c)))
        secs["whole"] += t1 - t0
        secs["local"] += time.perf_counter() - t1
    return got, secs


def _moved(a, b) -> int:
    """How many tensors or term scales differ between two runs' pairs."""
    n = 0
    for pa, pb in zip(a, b, strict=True):
        for x, y in zip(pa, pb, strict=True):
            if x is None:
                continue
            for oa, ob in zip(x, y, strict=True):
                n += sum(
                    getattr(oa, f) is not None and not torch.equal(getattr(oa, f), getattr(ob, f))
                    for f in FIELDS
                )
                n += oa.term_scale != ob.term_scale
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cases = [c for c in default_battery(4) if c.serving is None] + _mid_cases()
    full = tile_store.BUDGET_BYTES
    times: dict[str, dict[str, list[float]]] = {"kept": {}, "formed": {}}
    runs = {}
    for _ in range(a.rounds):
        for way, budget in (("formed", 0), ("kept", full)):
            runs[way], secs = _oracles(cases, budget)
            for k, v in secs.items():
                times[way].setdefault(k, []).append(v)
    tile_store.BUDGET_BYTES = full
    moved = _moved(runs["kept"], runs["formed"])
    print(f"{len(cases)} cases: the battery's training cases and the same lengthened")
    for k in ("whole", "local"):
        f, kk = (statistics.median(times[w][k]) for w in ("formed", "kept"))
        print(f"  {k:5s} formed again {f:.2f} s, kept {kk:.2f} s: x{kk / f:.3f}")
    print(f"outputs or term scales that moved: {moved}")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
