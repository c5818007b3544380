"""Judge one long case end to end with `ring-harness replay` (issues #12 and #21) and report its
wall time and every process's peak memory: the parent (which assembles the oracle and judges) and
each rank (which runs the ring, then computes its share of the oracle under `--oracle ranks`).

    python scripts/long_case.py                          # 32,768 tokens, W=4, zigzag causal bf16 h4 d64
    python scripts/long_case.py --tokens 65536 --world 8  # judged, or refused up front with the estimate
    python scripts/long_case.py --oracle local           # the single-process oracle, for comparison

The case is written to a temporary YAML file and replayed through `harness.checks.replay.replay`
(what the command line runs). Peak memory: the largest resident set sampled every SAMPLE_S
seconds for this process and each of its child processes (the ranks), plus the parent's own
kernel high-water mark (VmHWM). Exit status: the replay's (0 pass, 1 fail), 2 when the case is
refused (too large: the memory estimate is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_S = 0.5


def _status(pid: int | str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _kib(text: str | None) -> int:
    return int(text.split()[0]) * 1024 if text else 0


class Sampler:
    """The peak resident bytes of this process and of every process descending from it, by pid."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _descendants(self) -> list[int]:
        me = os.getpid()
        parents: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                st = _status(d)
                if "PPid" in st:
                    parents[int(d)] = int(st["PPid"])
        out, frontier = [], [me]
        while frontier:
            p = frontier.pop()
            kids = [c for c, pp in parents.items() if pp == p]
            out += kids
            frontier += kids
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in [os.getpid(), *self._descendants()]:
                st = _status(pid)
                rss = _kib(st.get("VmRSS"))
                if rss > self.peaks.get(pid, 0):
                    self.peaks[pid] = rss
                    try:
                        self.names[pid] = (
                            Path(f"/proc/{pid}/cmdline")
                            .read_bytes()
                            .replace(b"\0", b" ")
                            .decode()[:120]
                        )
                    except OSError:
                        pass
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--world", dest="world_size", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--oracle", choices=("ranks", "local"), default="ranks")
    p.add_argument(
        "--deadline", type=float, default=3600.0, help="the case's deadline for the ring (s)"
    )
    a = p.parse_args(argv)

    from harness import case as case_mod
    from harness.checks.options import ReplayOptions
    from harness.checks.replay import replay
    from harness.errors import HarnessError, RingHarnessError
    from harness.ranks import oom

    case = case_mod.make_case(
        world_size=a.world_size,
        total_len=a.tokens,
        layout="zigzag",
        mask={"kind": "causal"},
        dtype=a.dtype,
        heads_q=a.heads,
        heads_kv=a.heads,
        head_dim=a.head_dim,
        seed=5,
        deadline_s=a.deadline,
    )
    est = oom.estimate(case, oracle=a.oracle)
    print(f"case: {case.summary()}; estimate: {est.words()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "long-case.yaml"
        case_mod.save(case, path)
        t0 = time.perf_counter()
        try:
            with Sampler() as s:
                rp = replay(ReplayOptions(case=str(path), oracle=a.oracle))
        except HarnessError as e:
            print(f"refused: {e}")
            return 2
        except RingHarnessError as e:  # e.g. a rank died computing its oracle share
            print(f"harness error after {time.perf_counter() - t0:.0f} s: {e}")
            return 3
        wall = time.perf_counter() - t0
    gib = 1 << 30
    print(
        f"wall {wall:.0f} s (oracle {a.oracle}); verdict {rp.result.verdict}; timings: "
        + ", ".join(
            f"{k} {v:.1f} s"
            for k, v in sorted(rp.result.timings.items())
            if isinstance(v, float) and k.endswith("_s")
        )
    )
    me = os.getpid()
    print(
        f"peak RSS: parent {s.peaks.get(me, 0) / gib:.2f} GiB (VmHWM "
        f"{_kib(_status(me).get('VmHWM')) / gib:.2f} GiB)"
    )
    ranks = sorted(
        pid for pid in s.peaks if pid != me and "harness.ranks.worker" in s.names.get(pid, "")
    )
    for pid in ranks:
        print(f"peak RSS: rank process {pid} {s.peaks[pid] / gib:.2f} GiB")
    return 0 if rp.result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
