"""The default check's wall and CPU time on several commits, run in turn so that load hits each
alike.

    python scripts/compare_check_wall.py 4ccf9ca 0a90f91 HEAD --runs 3 -- --no-variants

Each commit is checked out as a git worktree in a temporary directory and runs
`python -m harness check ARGS` with its own code on the path, the ranks' too (PYTHONPATH). Round r
runs every commit once, in the order given. It prints each run, then each commit's median and its
ratio to the first commit's. CPU is the seconds of every process of the check (the check, the
zygote and the ranks, all reaped), from the children's rusage. Wall time moves with the machine's
load, so compare medians of one invocation, never figures from two.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(tree: Path, args: list[str], log: Path) -> tuple[int, float, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cpu0 = _children_cpu()
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.call(
            [sys.executable, "-m", "harness", "check", "--save-dir", str(log.parent), *args],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu0
    lines = log.read_text().strip().splitlines()
    return rc, wall, cpu, lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="commits, the first the baseline")
    ap.add_argument("--runs", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, args = ap.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: check's own options
    walls: dict[str, list[float]] = {r: [] for r in a.revs}
    cpus: dict[str, list[float]] = {r: [] for r in a.revs}
    with tempfile.TemporaryDirectory(prefix="rh-cmp-") as tmp:
        trees = {}
        for rev in a.revs:
            trees[rev] = Path(tmp) / rev.replace("/", "_")
            subprocess.check_call(
                ["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(trees[rev]), rev],
                stdout=subprocess.DEVNULL,
            )
        try:
            for i in range(1, a.runs + 1):
                for rev in a.revs:
                    rc, wall, cpu, last = _run(trees[rev], args, Path(tmp) / f"{rev}-{i}.log")
                    walls[rev].append(wall)
                    cpus[rev].append(cpu)
                    print(
                        f"{rev} run {i}: exit {rc}, {wall:.1f} s wall, {cpu:.1f} s CPU; "
                        f"{last[:160]}",
                        flush=True,
                    )
                    if rc not in (0, 1):  # not a verdict: a bad option, or a crash
                        return rc
        finally:
            for tree in trees.values():
                subprocess.call(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)]
                )
    base = statistics.median(walls[a.revs[0]])
    base_cpu = statistics.median(cpus[a.revs[0]])
    for rev in a.revs:
        m, c = statistics.median(walls[rev]), statistics.median(cpus[rev])
        print(
            f"{rev}: median {m:.1f} s wall, x{m / base:.3f} of {a.revs[0]}; median {c:.1f} s CPU, "
            f"x{c / base_cpu:.3f} (over {a.runs} runs)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
