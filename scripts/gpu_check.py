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

This file runs the steps and writes the report. The steps are listed in gpu_check_plan.py, the NCCL
ones in gpu_check_nccl.py, and a step's parts in gpu_check_common.py. The code each step runs in its
subprocess is in gpu_check_steps.py.
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
from dataclasses import asdict, dataclass
from pathlib import Path

# beside this script: scripts/ is on the path
from gpu_check_plan import Step, plan
from gpu_check_steps import (
    PY,
    env_facts,
    group_alive,
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
        # anything the step left in its group: reported, then killed
        left = not timed_out and group_alive(p)
        signal_group(p, signal.SIGKILL)
    secs = time.monotonic() - t0
    outcome = "timed out" if timed_out else _outcome(rc, step.expect)
    o = Outcome(
        step.name, step.what, outcome, round(secs, 1), cmd, rc, log=str(log.relative_to(out))
    )
    o.summary = ("left processes running (killed); " if left else "") + _summary(
        log, timed_out, limit
    )
    if step.json and os.path.exists(step.json):
        try:
            o.details = _details(json.loads(Path(step.json).read_text()))
        except (OSError, ValueError) as e:
            o.details = {"unreadable": str(e)}
    return o


def _outcome(rc: int, expect: tuple[int, ...]) -> str:
    """What an exit status means for a step: a broken ring's step expects its failure."""
    if rc in expect:
        return "passed" if rc == 0 else f"as expected (exit {rc})"
    if expect != (0,) and rc == 0:
        return "failed (expected a failure)"
    return RC_OUTCOMES.get(rc, "error")


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
        "verdict hang",
        "fail-stop",
        "rank",
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


def _parser() -> argparse.ArgumentParser:
    """The script's flags. The hidden ones run one step's own code in a subprocess."""
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
    return p


def _step_code(a: argparse.Namespace) -> int | None:
    """Run a step's own code if a hidden flag asks for it: its exit status, or None."""
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
    return None


def _environment(out: Path, budget: float) -> tuple[Outcome, dict]:
    """The first step: the environment's facts, which the plan's steps depend on."""
    env_step = Step(
        "environment", "torch, CUDA and NCCL versions, the devices", [PY, __file__, "--env"], 60
    )
    first = run_step(env_step, out, budget)
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
    return first, facts


def _run_plan(
    a: argparse.Namespace,
    out: Path,
    facts: dict,
    outcomes: list[Outcome],
    started: str,
    t0: float,
) -> list[Outcome]:
    """Run the plan's steps after `outcomes`, each within the budget left. Every step rewrites the
    report."""
    outcomes = list(outcomes)
    only = set(a.only.split(",")) if a.only else None
    for step in plan(a.device, out, facts):
        if only is not None and step.name not in only and not step.skip:
            step.skip = "not in --only"
        o = run_step(step, out, a.budget - (time.monotonic() - t0))
        outcomes.append(o)
        print(f"{o.name:26} {o.outcome:10} {o.seconds:7.1f} s  {o.summary[:150]}", flush=True)
        # a report even if killed
        write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    rc = _step_code(a)
    if rc is not None:
        return rc
    if not a.out:
        p.error("--out DIR is required")
    out = Path(a.out).resolve()
    (out / "steps").mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    first, facts = _environment(out, a.budget)
    outcomes = [first]
    if a.device == "cuda" and not facts.get("cuda_available"):
        print("--device cuda: torch sees no CUDA device here; use --device cpu", file=sys.stderr)
        write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
        return 2
    outcomes = _run_plan(a, out, facts, outcomes, started, t0)
    write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
    bad = [o for o in outcomes if o.outcome.startswith(("failed", "error", "timed out"))]
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
