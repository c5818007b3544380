"""scripts/gpu_check.py, the prepared GPU validation, on CPU: it runs from the checkout, bounds
every step, and writes a report listing every step with its outcome and seconds (the CUDA-only steps
skipped, with why). The whole CPU run (every step that applies, ~6 min here) is run by hand before
resolving (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_on_cpu_writes_a_report_of_every_step(tmp_path):
    """~20 s, slow tier (#55): every step of the prepared GPU run, on CPU; its refusal without a
    GPU is the README command test's, in the default suite."""
    out = tmp_path / "report"
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--budget",
            "200",
            "--only",
            "reference-cases",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["environment"]["outcome"] == "passed" and report["environment"]["torch"]
    assert steps["reference-cases"]["outcome"] == "passed"
    # W = 1, 2, 4, 8 x three layout/mask pairs
    assert len(steps["reference-cases"]["details"]) == 12
    for name in (
        "torch-cp",
        "torch-flex-cp-compiled",
        "nccl-smoke-w1",
        "torchrun-nccl-w1",
        "nccl-multi-rank-per-gpu",
        "nccl-hostid-w2",
        "nccl-hostid-w2-sockets",
        "nccl-hostid-w4",
    ):
        assert steps[name]["outcome"] == "skipped" and "CUDA only" in steps[name]["summary"]
    assert steps["check"]["outcome"] == "skipped" and steps["check"]["summary"] == "not in --only"
    assert all(isinstance(s["seconds"], float) for s in report["steps"])
    md = (out / "report.md").read_text()
    assert all(f"| {name} |" in md for name in steps)
    assert (tmp_path / "report.tar.gz").stat().st_size > 0  # all of it in one file


def test_a_step_past_its_limit_is_stopped_and_reported(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    (tmp_path / "steps").mkdir()
    hang = gpu_check.Step(
        "hang",
        "sleeps",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        timeout_s=1.0,
        min_s=0.5,
    )
    monkeypatch.setattr(gpu_check, "TERM_GRACE_S", 2.0)
    o = gpu_check.run_step(hang, tmp_path, left_s=100.0)
    assert o.outcome == "timed out" and o.seconds < 10
    short = gpu_check.run_step(hang, tmp_path, left_s=0.2)
    assert short.outcome == "skipped" and "budget" in short.summary


def test_an_adapter_whose_ranks_die_of_a_signal_stops_after_two_cases(tmp_path):
    """On the H200 a crashing adapter spent ~10 s per case restarting its ranks; its third case is
    not run."""
    out = tmp_path / "cases.json"
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--cases",
            "tests.helpers.impls:segfault",
            "--worlds",
            "2",
            "--device",
            "cpu",
            "--json-out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert [r["verdict"] for r in rows] == ["fail-stop", "fail-stop", "not run"]
    assert all("SIGSEGV" in d and "in _segfault" in d for r in rows[:2] for d in r["dead"].values())


def test_the_probe_step_is_judged_on_the_ops_the_harness_hands_gloo():
    """On the H100 raw gloo P2P and funcol's all-gather failed with CUDA tensors, as expected: the
    harness stages them. Those probes describe gloo; the staged ones and the collectives used raw
    decide the step."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_steps as steps
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    on_cuda = {name for name in steps.PROBES if not steps.probe_relied_on(name, "cuda")}
    assert on_cuda == {"isend-irecv", "funcol.all_gather_tensor", "funcol.reduce_scatter_tensor"}
    assert all(steps.probe_relied_on(name, "cpu") for name in steps.PROBES)
    assert steps.probe_relied_on("staged funcol.all_gather_tensor", "cuda")


def _scripts_module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_each_rank_gets_its_own_nccl_host_on_loopback_when_asked(tmp_path):
    """Issue #45: NCCL refuses two ranks on one GPU of one host. Each rank sets its own
    NCCL_HOSTID before NCCL starts, so NCCL sees separate nodes and connects them over sockets
    on lo. The steps run first, bounded, with NCCL's own log kept."""
    nccl = _scripts_module("gpu_check_nccl")
    plan = _scripts_module("gpu_check_plan")
    asked = {nccl.HOSTID_ENV: "1"}
    envs = [nccl.per_rank_nccl_env(r, asked) for r in range(4)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)
    assert (
        nccl.per_rank_nccl_env(1, {**asked, "NCCL_SOCKET_IFNAME": "eth0"})["NCCL_SOCKET_IFNAME"]
        == "eth0"
    )
    assert nccl.per_rank_nccl_env(0, {}) == {}
    facts = {"gpus": ["H200"], "nccl": "2.28.9"}
    steps = plan.plan("cuda", tmp_path, facts)
    names = [s.name for s in steps]
    assert names[:3] == ["nccl-hostid-w2", "nccl-hostid-w2-sockets", "nccl-hostid-w4"]
    for s in steps[:3]:
        assert not s.skip and s.timeout_s <= 60
        assert s.env[nccl.HOSTID_ENV] == "1" and s.env["NCCL_DEBUG"] == "INFO"
        assert s.env["SMOKE_GPU"] == "0" and s.argv[-1].endswith("nccl_smoke.py")
    assert steps[1].env["NCCL_NET"] == "Socket" and steps[1].env["NCCL_P2P_DISABLE"] == "1"
    assert (
        "--nproc-per-node" in steps[2].argv
        and steps[2].argv[steps[2].argv.index("--nproc-per-node") + 1] == "4"
    )
    smoke = (tmp_path / "steps" / "nccl_smoke.py").read_text()
    assert "@SCRIPTS_DIR@" not in smoke and str(ROOT / "scripts") in smoke
    compile(smoke, "nccl_smoke.py", "exec")
    # the part before torch: each rank finds the helper and sets its host, from any directory
    head = smoke.split("import torch")[0] + "print(os.environ['NCCL_HOSTID'])"
    env = {"LOCAL_RANK": "3", nccl.HOSTID_ENV: "1", "PATH": "/usr/bin:/bin"}
    got = subprocess.run(
        [sys.executable, "-c", head], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert got.stdout.strip() == "ring-harness-rank-3", got.stderr
    assert all(s.skip.startswith("CUDA only") for s in plan.plan("cpu", tmp_path, facts)[:3])


def test_the_shared_gpu_steps_run_the_check_under_share_gpu_and_expect_the_broken_rings(tmp_path):
    """Issue #45: after the NCCL_HOSTID smoke steps, the check at W = 2 and 4 with NCCL on one GPU
    (`--share-gpu`), and three broken rings whose step passes only when the job fails."""
    from harness.commands.cli import build_parser

    plan = _scripts_module("gpu_check_plan")
    gpu_check = _scripts_module("gpu_check")
    steps = {s.name: s for s in plan.plan("cuda", tmp_path, {"gpus": ["H200"], "nccl": "2.28.9"})}
    shared = [s for n, s in steps.items() if n.startswith("nccl-shared-")]
    assert {"nccl-shared-check-w2", "nccl-shared-check-w4", "nccl-shared-signal"} <= {
        s.name for s in shared
    }
    for s in shared:
        argv = s.argv
        harness_args = argv[argv.index("harness") + 1 :]
        opts = build_parser().parse_args(harness_args)
        assert opts.share_gpu and opts.backend == "nccl" and opts.launcher == "torchrun"
        assert argv[argv.index("--nproc-per-node") + 1] == str(opts.world_size)
        broken = s.name in ("nccl-shared-raise", "nccl-shared-hang", "nccl-shared-signal")
        assert s.expect == ((1,) if broken else (0,))
    assert gpu_check._outcome(1, (1,)) == "as expected (exit 1)"
    assert gpu_check._outcome(0, (1,)) == "failed (expected a failure)"
    assert gpu_check._outcome(1, (0,)) == "failed"
    assert gpu_check._outcome(0, (0,)) == "passed"
