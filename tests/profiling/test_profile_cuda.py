"""`ring-harness profile --device cuda` without a GPU: the refusal, and the plumbing of what CUDA ranks
send back (max_memory_allocated peaks, CUDA-event times), on made-up figures. scripts/gpu_check.py's
`profile-cuda` step runs it on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness.commands.cli import build_parser, main
from harness.errors import HarnessError
from harness.profiling import balance, devicetime, report, timeline
from harness.profiling.measure import CallProfile, RankProfile
from harness.profiling.memory import kv_token_bytes
from harness.ranks import instrument

ROOT = Path(__file__).resolve().parents[2]

# a ring step: post a receive, compute, wait; the last step waits on two ops with no compute between
EVENTS = [
    ["post", 0, "forward", 0.0],
    ["compute", 100, "forward", 0.1],
    ["wait", 0, "forward", 0.2],
    ["done", 0, "forward", 0.3],
    ["post", 1, "forward", 0.3],
    ["post", 2, "forward", 0.3],
    ["compute", 100, "forward", 0.4],
    ["wait", 1, "forward", 0.5],
    ["done", 1, "forward", 0.6],
    ["wait", 2, "forward", 0.6],
    ["done", 2, "forward", 0.7],
    ["post", 3, "backward", 0.7],
    ["wait", 3, "backward", 0.8],
    ["done", 3, "backward", 0.9],
]
OPS = [["irecv", 1, 64, "forward", "done"]] * 3 + [["irecv", 1, 64, "backward", "done"]]


def test_cuda_is_refused_in_one_line_where_torch_sees_no_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "--device", "cuda", "--max-world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and "no CUDA device" in err[0]
    with pytest.raises(HarnessError, match="no CUDA device"):
        report.profile("reference", device="cuda")


def test_waits_are_grouped_into_ring_steps_per_phase():
    rows = devicetime.steps(EVENTS, [(0, 1.5), (1, 0.25), (2, 0.5), (3, 2.0)])
    got = [(s.phase, s.step, s.waits, s.exposed_ms) for s in rows]
    assert got == [("forward", 0, 1, 1.5), ("forward", 1, 2, 0.75), ("backward", 0, 1, 2.0)]
    # a wait without a CUDA time (no "done": it failed) is left out
    assert [s.waits for s in devicetime.steps(EVENTS, [(0, 1.0), (3, 1.0)])] == [1, 1]
    t = devicetime.RankTimes(2, 10.0, rows)
    assert (t.exposed_ms, t.compute_ms, t.phase_ms("forward")) == (4.25, 5.75, 2.25)
    assert "forward 2.25 ms over steps 1.50, 0.75; backward 2.00 ms over steps 2.00" in t.line()
    assert "exposed communication 4.25 ms (42%)" in t.line()


def test_the_rank_side_pairs_each_wait_with_its_done(monkeypatch):
    class FakeEvent:
        def __init__(self, at: float) -> None:
            self.at = at

        def elapsed_time(self, end: FakeEvent) -> float:
            return end.at - self.at

    clock = iter(range(100))
    monkeypatch.setattr(instrument, "_cuda_event", lambda: FakeEvent(float(next(clock))))
    marks = instrument.CudaMarks()
    for e in EVENTS:
        marks.append(tuple(e))
    marks.append(("wait", 9, "backward", 1.0))  # never done: no time
    assert [list(e) for e in marks] == EVENTS + [["wait", 9, "backward", 1.0]]
    assert marks.elapsed() == [
        [0, "forward", 1.0],
        [1, "forward", 1.0],
        [2, "forward", 1.0],
        [3, "backward", 1.0],
    ]


def _cuda_call(case, impl: str) -> CallProfile:
    """A made-up CUDA call: the live-bytes tracker sees a flat peak, the device a K/V gather."""
    gathered = 100_000 + case.total_len * kv_token_bytes(case)
    ranks = [
        RankProfile(r, list(EVENTS), list(OPS), 50_000, 0.0, gathered, 12.0, [[0, "forward", 3.0]])
        for r in range(case.world_size)
    ]
    return CallProfile(case, impl, ranks)


def test_cuda_ranks_are_judged_on_max_memory_allocated(monkeypatch, tmp_path):
    fake = lambda case, pool, impl, allow_import=False: _cuda_call(case, impl)
    monkeypatch.setattr(report, "profile_call", fake)
    monkeypatch.setattr(balance, "profile_call", fake)
    pool = type("Pool", (), {"capacity": 4})()
    p = report.profile_ring("reference", pool, tokens_per_rank=16)
    assert p.memory.instrument == "cuda max_memory_allocated"
    assert p.memory.held_copies == pytest.approx(1.0)
    assert p.memory.verdict == p.memory.length.verdict == "O(n): gathers K/V" and not p.kept
    lines = p.lines()
    assert lines[1].endswith("; peak: cuda max_memory_allocated")
    head = next(i for i, x in enumerate(lines) if "cuda events (reported, not judged)" in x)
    assert "compute: the GPU waits on communication at most 25% of the call" in lines[head]
    assert lines[head + 1].strip().startswith("rank 0: call 12.00 ms, exposed communication 3.00")
    times = p.to_json()["cuda_times"]
    assert [t["rank"] for t in times] == [0, 1, 2, 3] and times[0]["steps"][0]["exposed_ms"] == 3.0
    assert p.to_json()["memory"]["instrument"] == "cuda max_memory_allocated"
    data = timeline.trace(p.call)
    assert timeline.valid(data) == []
    waits = [e for e in data["traceEvents"] if e.get("cat") == "wait"]
    assert [e["args"].get("cuda_ms") for e in waits[:2]] == [3.0, None]
    # CPU ranks: no CUDA figures, the live-bytes peak, no CUDA lines
    cpu = RankProfile(0, list(EVENTS), list(OPS), 50_000)
    assert cpu.peak == 50_000 and CallProfile(None, "x", [cpu]).instrument == "live tensor bytes"
    assert devicetime.lines(devicetime.device_times(CallProfile(None, "x", [cpu]))) == []


def _gpu_check_profile():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_common
        import gpu_check_profile

        return gpu_check_common, gpu_check_profile
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_gpu_step_is_skipped_off_cuda_and_its_command_parses(tmp_path):
    common, gp = _gpu_check_profile()
    (cpu,) = gp.profile_steps("cpu", tmp_path, {})
    assert cpu.name == "profile-cuda" and cpu.skip == common.cuda_only("cpu") != ""
    (cuda,) = gp.profile_steps("cuda", tmp_path, {})
    assert cuda.skip == "" and cuda.min_s == 60 and cuda.timeout_s >= 120
    assert cuda.argv[1:4] == ["-m", "harness", "profile"]
    args = build_parser().parse_args(cuda.argv[3:])
    assert args.device == "cuda" and args.impl == list(gp.RINGS) and args.max_world_size == 4
    trace = Path(args.trace)
    assert trace.parent == tmp_path / "steps" and Path(args.json).parent == tmp_path / "steps"
    assert cuda.json == args.json
