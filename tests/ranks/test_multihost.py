"""A multi-host run, tried on one machine: two torchrun agents (static rendezvous on 127.0.0.1),
two gloo ranks each, the check at W = 4. Node 1 holds ranks 2 and 3."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/ranks/...)
MARK = "RING_HARNESS_TEST_HOST"  # in every agent's and rank's environment: "<run id>-<node>"
# the battery alone: the cheapest check that still runs real cases on all four ranks
CHEAP = ["--no-scale", "--no-growth", "--no-repeat", "--fault-stage", "none", "--max-examples", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(prefix: str) -> list[int]:
    """Live processes (not zombies) whose environment carries MARK=<prefix...>."""
    needle = f"{MARK}={prefix}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(v.startswith(needle) for v in env.split(b"\0")):
            out.append(int(entry))
    return out


def _kill(prefix: str) -> None:
    """SIGKILL every process marked `prefix`: an agent and its ranks (torchrun starts each rank in
    a session of its own, so the agent's process group alone would miss them)."""
    for pid in _marked(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Hosts:
    """Two torchrun agents on this machine, each in its own session, their output in files."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        self.tmp_path, self.args = tmp_path, args
        self.out = [tmp_path / f"node{n}.out" for n in (0, 1)]
        self.err = [tmp_path / f"node{n}.err" for n in (0, 1)]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        port = str(_free_port())
        for node in (0, 1):
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            env[MARK] = f"{self.run_id}-{node}"
            agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            agent += ["--nproc-per-node", "2", "--node-rank", str(node)]
            agent += ["--master-addr", "127.0.0.1", "--master-port", port]
            check = ["-m", "harness", "check", "--launcher", "torchrun", "--world-size", "4"]
            check += ["--save-dir", str(self.tmp_path / "failures"), *self.args]
            with open(self.out[node], "w") as out, open(self.err[node], "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        agent + check,
                        stdout=out,
                        stderr=err,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )

    def text(self, node: int, stream: str = "out") -> str:
        return (self.out if stream == "out" else self.err)[node].read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> None:
        """Until rank 0's stdout matches `pattern`; fails at `timeout` or when an agent ends."""
        end = time.monotonic() + timeout
        while not re.search(pattern, self.text(0), re.M):
            assert time.monotonic() < end, f"no {pattern!r} in {timeout} s:\n{self.text(0)[-2000:]}"
            assert all(p.poll() is None for p in self.procs), self.text(0, "err")[-3000:]
            time.sleep(0.1)

    def wait(self, node: int, timeout: float) -> int:
        return self.procs[node].wait(timeout=timeout)

    def close(self) -> list[int]:
        """Kill whatever is left of both hosts; the pids still alive 10 s after the agents ended
        (an agent tears its own ranks down as it exits)."""
        end = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while (left := _marked(self.run_id)) and time.monotonic() < end:
            time.sleep(0.2)
        _kill(self.run_id)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        return left


@pytest.mark.slow
def test_check_across_two_hosts_passes(tmp_path):
    """The battery at W = 4 across two agents passes. Slow tier (about 15 s idle, a full battery): it
    guards what one host's torchrun tests cannot, every case run across a two-agent rendezvous by
    ranks whose RANK is not their LOCAL_RANK (ranks 2 and 3 are node 1's local ranks 0 and 1)."""
    hosts = _Hosts(tmp_path, CHEAP)
    try:
        hosts.start()
        codes = [hosts.wait(n, timeout=240) for n in (0, 1)]
        assert codes == [0, 0], hosts.text(0)[-3000:] + hosts.text(0, "err")[-3000:]
        out = hosts.text(0)
        assert "gloo ranks (torchrun, 4 ranks)" in out and out.count(" pass ") >= 50, out[-3000:]
        assert out.splitlines()[-1].startswith("check PASSED (exit 0)"), out[-3000:]
        assert hosts.text(1) == ""  # rank 0 alone reports
    finally:
        left = hosts.close()
    assert left == []


def test_a_lost_host_ends_the_survivor_in_time_naming_its_ranks(tmp_path):
    """Node 1's agent and its ranks (2 and 3) die of SIGKILL mid-battery: node 0's agent ends well
    within the case deadline, a surviving rank names ranks 2 and 3, no traceback of ours, and no
    process of either host is left. Default suite (about 9 s idle): the only test of a lost host, and
    the cheapest of a two-agent rendezvous."""
    deadline = 20
    hosts = _Hosts(tmp_path, [*CHEAP, "--deadline", str(deadline)])
    try:
        hosts.start()
        hosts.wait_for(r"^\s*2/\d+\s", timeout=180)  # the battery runs on all four ranks
        killed = time.monotonic()
        _kill(f"{hosts.run_id}-1")
        code = hosts.wait(0, timeout=deadline + 60)
        took = time.monotonic() - killed
        err = hosts.text(0, "err")
        assert code == 1 and hosts.wait(1, timeout=30) == -signal.SIGKILL, err[-3000:]
        assert took < deadline, f"{took:.1f} s\n{err[-3000:]}"
        assert re.search(
            r"ring-harness: rank [01]: a peer rank ended during case \d+ \(.*\); "
            r"ranks 2, 3 did not answer within 3 s: their host or processes ended",
            err,
        ), err[-3000:]
        assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err[-3000:]
    finally:
        left = hosts.close()
    assert left == []
