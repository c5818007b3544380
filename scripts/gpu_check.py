"""The prepared GPU validation (issue #32): every CUDA path of ring-harness, each step bounded, one
report.

    python scripts/gpu_check.py --out DIR [--device cuda|cpu] [--budget SECONDS]

Runs from a plain checkout (no pip install: the checkout is put on the path). Each step is a
subprocess with its own time limit (SIGTERM, then SIGKILL of its process group), so one hang cannot
eat the rest; a step that would start with less than its minimum of the budget left is skipped.
Writes DIR/report.md and DIR/report.json (every step: outcome, seconds, what it ran, a summary),
DIR/steps/*.log, and all of DIR as DIR.tar.gz. `--device cpu` runs the same steps on CPU gloo ranks
with P2P staging forced; the CUDA-only ones are reported as skipped. Outcomes: passed, failed (the
ring is wrong: exit 1), refused (exit 2), error (any other exit), timed out, skipped. Exit 0 when no
step failed, errored or timed out, else 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpu_check_steps import (  # beside this script: scripts/ is on the path
    PY,
    SMOKE,
    env_facts,
    nccl_at_least,
    probe_collectives,
    probe_one,
    run_cases,
    signal_group,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TERM_GRACE_S = 10.0  # a step's time to write its partial report after SIGTERM
# what a step's exit status means (harness/commands: 0 passed, 1 the ring is wrong, 2 bad input)
RC_OUTCOMES = {0: "passed", 1: "failed", 2: "refused"}


@dataclass
class Step:
    """One bounded step: a command, its time limit, the least budget it needs to start, and when it
    applies."""

    name: str
    what: str
    argv: list[str]
    timeout_s: float
    min_s: float = 20.0
    skip: str = ""  # why it does not apply here ('' = it runs)
    env: dict[str, str] = field(default_factory=dict)
    json: str | None = None  # a JSON file the step writes (summarised into the report)


@dataclass
class Outcome:
    name: str
    what: str
    outcome: str
    seconds: float
    command: str
    rc: int | None = None
    summary: str = ""
    log: str = ""
    details: dict | list | None = None


# -- planning and running the steps
# ---------------------------------------------------------------------- the cheap and never-run
# steps first
STEP_ORDER = [
    "gloo-collectives",
    "reference-cases",
    "torch-cp",
    "torch-cp-alltoall",
    "torch-flex-cp",
    "torch-flex-cp-compiled",
    "long-32k",
    "long-4k",
    "nccl-smoke-w1",
    "torchrun-nccl-w1",
    "torchrun-nccl-multi",
    "nccl-multi-rank-per-gpu",
    "check",
    "selftest-subset",
    "deepspeed-ulysses",
    "deepspeed-ulysses-seqfirst",
    "deepspeed-alst",
    "deepspeed-uneven-length",
    "deepspeed-fpdt",
]


def plan(device: str, out: Path, facts: dict) -> list[Step]:
    """Every step for `device`, in the order they run; the ones that do not apply here carry why."""
    steps = [
        *_harness_steps(device, out, facts),
        *_deepspeed_steps(device, out, facts),
        *_nccl_steps(device, out, facts),
    ]
    return sorted(steps, key=lambda s: STEP_ORDER.index(s.name))


def _json(out: Path, name: str) -> str:
    """Where a step writes its JSON."""
    return str(out / "steps" / f"{name}.json")


def _device_args(device: str) -> list[str]:
    return ["--device", device] + ([] if device == "cuda" else ["--stage-p2p"])


def _no_cuda(device: str) -> str:
    """Why a CUDA-only step does not apply ('' on cuda)."""
    return "" if device == "cuda" else "CUDA only: run with --device cuda on a GPU host"


def _cases(out: Path, device: str, name: str, impl: str, worlds: str, **kw) -> list[str]:
    """The command of a step that runs a few judged cases (`gpu_check.py --cases`)."""
    flags = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [
        PY,
        str(Path(__file__).resolve()),
        "--cases",
        impl,
        "--worlds",
        worlds,
        "--device",
        device,
        "--json-out",
        _json(out, name),
        *flags,
    ]


def _harness_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """The probes, the cases of the reference and of torch's CP, the check, the selftest,
    torchrun."""
    cuda = device == "cuda"
    gpus = len(facts.get("gpus") or [])
    me = [PY, str(Path(__file__).resolve())]
    dev = _device_args(device)
    js = lambda name: _json(out, name)  # noqa: E731
    check = [PY, "-m", "harness", "check", *dev]
    no_cuda = _no_cuda(device)
    cases = lambda *args, **kw: _cases(out, device, *args, **kw)  # noqa: E731
    return [
        Step(
            "gloo-collectives",
            "what gloo does with the device's tensors: each P2P op and "
            "collective the rings "
            "use, on two gloo ranks (right, wrong, error, crashed, hung)",
            me + ["--probe-collectives", "--device", device, "--json-out", js("gloo-collectives")],
            60,
            json=js("gloo-collectives"),
        ),
        Step(
            "reference-cases",
            "the reference ring at W = 1, 2, 4, 8 (contiguous/zigzag, "
            "none/causal, bf16, "
            "h4 d64, 256 tokens a rank), oracle on the ranks' devices",
            cases("reference-cases", "reference", "1,2,4,8"),
            90,
            json=js("reference-cases"),
        ),
        Step(
            "torch-cp",
            "torch's context_parallel (SDPA flash/efficient, allgather rotation) at W "
            "= 2, 4 with "
            "backward",
            cases("torch-cp", "torch-cp", "2,4"),
            75,
            skip=no_cuda,
            json=js("torch-cp"),
        ),
        Step(
            "torch-cp-alltoall",
            "torch's context_parallel, alltoall rotation, at W = 2, 4 with backward",
            cases("torch-cp-alltoall", "torch-cp-alltoall", "2,4"),
            75,
            skip=no_cuda,
            json=js("torch-cp-alltoall"),
        ),
        Step(
            "torch-flex-cp",
            "flex attention under torch's CP (eager) at W = 2, 4 with backward",
            cases("torch-flex-cp", "torch-flex-cp", "2,4"),
            75,
            skip=no_cuda,
            json=js("torch-flex-cp"),
        ),
        Step(
            "torch-flex-cp-compiled",
            "flex attention compiled (Triton) under torch's CP at W = 2, 4, backward",
            cases("torch-flex-cp-compiled", "torch-flex-cp-compiled", "2,4"),
            120,
            min_s=40,
            skip=no_cuda,
            json=js("torch-flex-cp-compiled"),
        ),
        Step(
            "long-32k" if cuda else "long-4k",
            "one 32,768-token zigzag causal bf16 case at W = 8, judged with the float64 oracle on "
            "the GPU"
            if cuda
            else "one 4,096-token case at W = 8 (32k on CPU takes too long here), oracle on the "
            "ranks",
            cases("long", "reference", "8", tokens_per_rank=4096 if cuda else 512, case_set="long"),
            120,
            min_s=30,
            json=js("long"),
        ),
        Step(
            "check",
            "the default check of the reference at --world-size 8: battery (W = 1, 2, 3, "
            "4, 8), scale "
            "stage, growth check, fault stage (early-read, send-reuse), 10 property-based examples",
            check
            + [
                "--world-size",
                "8",
                "--max-examples",
                "10",
                "--json",
                js("check"),
                "--save-dir",
                str(out / "failures"),
            ],
            180,
            min_s=60,
            json=js("check"),
        ),
        Step(
            "selftest-subset",
            "the selftest's fast subset (one mutant per stage) on the device",
            [
                PY,
                "-m",
                "harness",
                "selftest",
                *dev,
                "--only",
                "naive-merge-sum,out-merge-in-input-dtype,tile-tail-dropped,read-before-wait",
                "--json",
                js("selftest"),
                "--save-dir",
                str(out / "selftest"),
            ],
            180,
            min_s=60,
            json=js("selftest"),
        ),
        Step(
            "torchrun-nccl-w1",
            "torchrun with NCCL at W = 1: the check's battery on cuda:LOCAL_RANK, oracle there",
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                "-m",
                "harness",
                "check",
                "--launcher",
                "torchrun",
                "--backend",
                "nccl",
                "--world-size",
                "1",
                "--max-examples",
                "5",
                "--no-growth",
                "--json",
                js("torchrun"),
                "--save-dir",
                str(out / "failures-torchrun"),
            ],
            120,
            min_s=40,
            skip=no_cuda,
            json=js("torchrun"),
        ),
        Step(
            "torchrun-nccl-multi",
            "torchrun with NCCL at W = number of GPUs (> 1)",
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(max(gpus, 2)),
                "-m",
                "harness",
                "check",
                "--launcher",
                "torchrun",
                "--backend",
                "nccl",
                "--world-size",
                str(max(gpus, 2)),
                "--max-examples",
                "5",
                "--no-growth",
            ],
            120,
            min_s=40,
            skip=no_cuda or ("" if gpus >= 2 else f"needs two GPUs; this host has {gpus}"),
        ),
    ]


def _deepspeed_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """DeepSpeed's Ulysses, ALST and FPDT checks, and the corpus case of DeepSpeed #7384."""
    cuda = device == "cuda"
    dev = _device_args(device)
    js = lambda name: _json(out, name)  # noqa: E731
    check = [PY, "-m", "harness", "check", *dev]
    steps = []
    ds = (
        ""
        if facts.get("deepspeed")
        else "deepspeed is not importable here (pip install 'ring-harness[deepspeed]')"
    )
    hf = ds or (
        ""
        if facts.get("transformers")
        else "transformers is not importable here (ALST's attention)"
    )
    for impl in ("deepspeed-ulysses", "deepspeed-ulysses-seqfirst", "deepspeed-alst"):
        steps.append(
            Step(
                impl,
                f"the default check of {impl} (torch's SDPA on the device) without "
                "the fault stage: "
                "battery, scale stage at training sizes, growth and repeat checks, 10 "
                "property-based "
                "examples",
                check
                + [
                    "--impl",
                    impl,
                    "--max-examples",
                    "10",
                    "--fault-stage",
                    "none",
                    "--json",
                    js(impl),
                    "--save-dir",
                    str(out / "failures"),
                ],
                150,
                min_s=45,
                skip=hf if impl == "deepspeed-alst" else ds,
                json=js(impl),
            )
        )
    steps.append(
        Step(
            "deepspeed-uneven-length",
            "DeepSpeed #7384 (S % W != 0) on the device's "
            "tensors: the "
            "corpus case that aborts a rank on CPU gloo",
            [
                PY,
                "-m",
                "harness",
                "replay",
                str(ROOT / "cases" / "deepspeed-ulysses-uneven-length.yaml"),
                *dev,
                "--json",
                js("deepspeed-uneven-length"),
            ],
            60,
            skip=ds,
            json=js("deepspeed-uneven-length"),
        )
    )
    steps.append(
        Step(
            "deepspeed-fpdt",
            "the default check of deepspeed-fpdt (flash-attn) without the fault stage",
            check
            + [
                "--impl",
                "deepspeed-fpdt",
                "--max-examples",
                "10",
                "--fault-stage",
                "none",
                "--json",
                js("deepspeed-fpdt"),
                "--save-dir",
                str(out / "failures"),
                # CPU: ci/thirdparty-check.sh's why
                *([] if cuda else ["--no-scale"]),
            ],
            150,
            min_s=45,
            skip=ds
            or ("" if facts.get("flash_attn") or not cuda else "needs flash-attn on a GPU host"),
            json=js("deepspeed-fpdt"),
        )
    )
    return steps


def _nccl_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """NCCL itself: at W = 1, and two ranks on one GPU where NCCL allows it. Writes the smoke
    script."""
    no_cuda = _no_cuda(device)
    steps = []
    smoke = out / "steps" / "nccl_smoke.py"
    nccl = facts.get("nccl")
    mr_skip = no_cuda or (
        ""
        if nccl_at_least(nccl, (2, 30))
        else f"NCCL {nccl} < 2.30 has no NCCL_MULTI_RANK_GPU_ENABLE (it refuses two "
        "ranks on one GPU)"
    )
    mps = f"at {facts['mps_pipe']}" if facts.get("mps_pipe") else "not running"
    steps.append(
        Step(
            "nccl-multi-rank-per-gpu",
            "NCCL >= 2.30's experimental two ranks on one GPU "
            f"(NCCL_MULTI_RANK_GPU_ENABLE=1; MPS {mps})",
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(smoke),
            ],
            45,
            skip=mr_skip,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "1", "SMOKE_GPU": "0"},
        )
    )
    steps.append(
        Step(
            "nccl-smoke-w1",
            "NCCL itself at W = 1 (init, all_reduce) before the harness's torchrun step",
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                str(smoke),
            ],
            45,
            skip=no_cuda,
        )
    )
    smoke.parent.mkdir(parents=True, exist_ok=True)
    smoke.write_text(SMOKE)
    return steps


def run_step(step: Step, out: Path, left_s: float) -> Outcome:
    """Run one step within min(its limit, the budget left); SIGTERM, then SIGKILL, its process group
    on time."""
    cmd = " ".join(step.argv)
    if step.skip:
        return Outcome(step.name, step.what, "skipped", 0.0, cmd, summary=step.skip)
    if left_s < step.min_s:
        return Outcome(
            step.name,
            step.what,
            "skipped",
            0.0,
            cmd,
            summary=f"budget: {left_s:.0f} s left, the step needs at least {step.min_s:.0f} s",
        )
    limit = min(step.timeout_s, left_s)
    log = out / "steps" / f"{step.name}.log"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        **step.env,
    )
    env.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(out / "hypothesis"))
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        p = subprocess.Popen(
            step.argv,
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = False
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            signal_group(p, signal.SIGTERM)
            try:
                rc = p.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(p, signal.SIGKILL)
                rc = p.wait()
        signal_group(p, signal.SIGKILL)  # anything the step left in its group
    secs = time.monotonic() - t0
    outcome = "timed out" if timed_out else RC_OUTCOMES.get(rc, "error")
    o = Outcome(
        step.name, step.what, outcome, round(secs, 1), cmd, rc, log=str(log.relative_to(out))
    )
    o.summary = _summary(log, timed_out, limit)
    if step.json and os.path.exists(step.json):
        try:
            o.details = _details(json.loads(Path(step.json).read_text()))
        except (OSError, ValueError) as e:
            o.details = {"unreadable": str(e)}
    return o


def _summary(log: Path, timed_out: bool, limit: float) -> str:
    """The step's last telling line(s): a verdict line of the check, or the log's tail."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    keys = (
        "check PASSED",
        "check FAILED",
        "selftest",
        "killed",
        "Error",
        "error:",
        "ok on cuda",
        "refused",
        "probes:",
    )
    telling = [ln for ln in lines if any(k in ln for k in keys)]
    text = " | ".join((telling or lines)[-3:])[:600]
    return (f"stopped at its {limit:.0f}-s limit; " if timed_out else "") + text


def _details(data) -> dict | list:
    """What the report keeps of a step's JSON: per-case rows, or a check's stage outcome in
    brief."""
    if isinstance(data, list):
        return data
    if not isinstance(data, dict):
        return {}
    keep = {
        k: data[k]
        for k in (
            "passed",
            "exit",
            "cases",
            "failures",
            "stage_seconds",
            "stopped",
            "killed",
            "mutants",
            "interrupted",
        )
        if k in data
    }
    if "growth" in data and isinstance(data["growth"], dict):
        keep["growth"] = {
            k: v
            for k, v in data["growth"].items()
            if k in ("passed", "worlds", "verdict", "ratios")
        }
    return keep


def write_report(
    out: Path, device: str, facts: dict, outcomes: list[Outcome], started: str, wall: float
) -> None:
    gpu = ", ".join(g["name"] for g in facts.get("gpus") or []) or "none"
    report = {
        "date": started,
        "device": device,
        "gpus": gpu,
        "wall_s": round(wall, 1),
        "environment": facts,
        "steps": [asdict(o) for o in outcomes],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    md = [
        f"# ring-harness GPU check, {started}",
        "",
        f"- device: `{device}`; GPUs: {gpu}; torch {facts.get('torch')} (CUDA "
        f"{facts.get('cuda_build')}), "
        f"NCCL {facts.get('nccl', '-')}; {facts.get('host_cpus')} host CPUs",
        f"- command: `python scripts/gpu_check.py --out DIR --device {device}`; wall {wall:.0f} s",
        "",
        "| step | outcome | seconds | summary |",
        "|---|---|---:|---|",
    ]
    for o in outcomes:
        md.append(
            f"| {o.name} | {o.outcome} | {o.seconds:.1f} | {o.summary.replace('|', '/')[:300]} |"
        )
    md += ["", "## What each step ran", ""]
    for o in outcomes:
        md.append(f"- **{o.name}**: {o.what}. `{o.command[:400]}`")
        if isinstance(o.details, list):
            for row in o.details:
                md.append(
                    f"  - {row.get('verdict')}: {row.get('case')} "
                    f"{row.get('worst_ratio', '')} "
                    f"{row.get('detail', '')[:200]} {row.get('errors') or ''} "
                    f"{row.get('dead') or ''}".rstrip()
                )
    (out / "report.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the folder the report goes to (created)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--budget", type=float, default=600.0, help="seconds for every step together (default 600)"
    )
    p.add_argument(
        "--only", help="comma list of step names to run (the others are reported as skipped)"
    )
    # a step's own code, run in a subprocess
    p.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--worlds", default="2,4", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("--tokens-per-rank", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--case-set", default="basic", help=argparse.SUPPRESS)
    p.add_argument("--probe-collectives", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--probe-store", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe:
        return probe_one(a.probe, a.probe_rank, a.probe_store, a.device)
    if a.probe_collectives:
        return probe_collectives(a.device, a.json_out)
    if a.env:
        print(json.dumps(env_facts()))
        return 0
    if a.cases:
        return run_cases(
            a.cases,
            [int(w) for w in a.worlds.split(",")],
            a.device,
            a.tokens_per_rank,
            a.case_set,
            "bf16",
            4,
            64,
            a.json_out,
        )
    if not a.out:
        p.error("--out DIR is required")
    out = Path(a.out).resolve()
    (out / "steps").mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    env_step = Step(
        "environment", "torch, CUDA and NCCL versions, the devices", [PY, __file__, "--env"], 60
    )
    first = run_step(env_step, out, a.budget)
    try:
        lines = (out / first.log).read_text().strip().splitlines()
        facts = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        facts = {}
    first.details = facts
    first.summary = (
        f"torch {facts.get('torch')}, CUDA {facts.get('cuda_build')}, NCCL "
        f"{facts.get('nccl', '-')}, "
        f"GPUs: {', '.join(g['name'] for g in facts.get('gpus') or []) or 'none'}"
    )
    outcomes = [first]
    if a.device == "cuda" and not facts.get("cuda_available"):
        print("--device cuda: torch sees no CUDA device here; use --device cpu", file=sys.stderr)
        write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
        return 2
    only = set(a.only.split(",")) if a.only else None
    for step in plan(a.device, out, facts):
        if only is not None and step.name not in only and not step.skip:
            step.skip = "not in --only"
        o = run_step(step, out, a.budget - (time.monotonic() - t0))
        outcomes.append(o)
        print(f"{o.name:26} {o.outcome:10} {o.seconds:7.1f} s  {o.summary[:150]}", flush=True)
        # a report even if killed
        write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
    write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
    bad = [o for o in outcomes if o.outcome in ("failed", "error", "timed out")]
    # one file: the GPU tool returns few
    archive = shutil.make_archive(str(out), "gztar", out.parent, out.name)
    print(
        f"report: {out / 'report.md'} (all of it: {archive}); {len(outcomes)} steps, {len(bad)} "
        "failed/errored/"
        f"timed out, {time.monotonic() - t0:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
