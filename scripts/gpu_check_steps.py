"""The code each step of scripts/gpu_check.py runs in its own subprocess.

gpu_check.py runs itself with `--env`, `--cases`, `--probe-collectives` or `--probe`; those call the
functions here. The environment's facts, a few judged cases of one implementation, and what gloo
does with the device's tensors, op by op. The NCCL smoke test is in gpu_check_nccl.py.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
SCRIPT = Path(__file__).resolve().with_name("gpu_check.py")  # the probes run it with --probe


def env_facts() -> dict:
    """torch, CUDA, NCCL, the devices, and whether MPS and NCCL's multi-rank-per-GPU opt-in could
    apply."""
    import torch
    import torch.distributed as dist

    facts: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
        "host_cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        facts["gpus"] = [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(n)
        ]
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # no NCCL in this build
            facts["nccl"] = f"unknown ({type(e).__name__})"
    facts["mps_pipe"] = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or (
        "/tmp/nvidia-mps" if os.path.exists("/tmp/nvidia-mps") else ""
    )
    for mod in (
        "flash_attn",
        "transformer_engine",
        "triton",
        "hypothesis",
        "yaml",
        "numpy",
        "deepspeed",
        "transformers",
    ):
        try:
            m = __import__(mod)
            facts[mod] = getattr(m, "__version__", "present")
        except Exception:
            facts[mod] = None
    return facts


def nccl_at_least(version: str | None, want: tuple[int, int]) -> bool:
    try:
        parts = tuple(int(x) for x in str(version).split(".")[:2])
    except ValueError:
        return False
    return parts >= want


# cases in a row whose ranks die of a signal before an adapter's remaining cases are not run
SIGNAL_DEATHS = 2
CASE_SETS = {
    # (layout, mask): the basics a CP implementation is used with; adapted to what the impl declares
    "basic": (("contiguous", "none"), ("zigzag", "causal"), ("contiguous", "causal")),
    "long": (("zigzag", "causal"),),
}


def run_cases(
    impl: str,
    worlds: list[int],
    device: str,
    tokens_per_rank: int,
    case_set: str,
    dtype: str,
    heads: int,
    head_dim: int,
    out: str,
) -> int:
    """Run a few cases of `impl` at each ring size in `worlds` on one pool and judge them with the
    float64 oracle computed by the ranks on their device. Exit 0 all passed, 1 one failed, 2 none
    could run. After SIGNAL_DEATHS cases in a row whose ranks were killed by a signal, the rest are
    not run (each costs a restart of a GPU host's scarce minutes and would die the same way)."""
    from harness.impls import registry
    from harness.ranks.backend import Placement
    from harness.ranks.pool import RankPool
    from harness.runner import run_case

    cases, refused = _adapted_cases(impl, worlds, tokens_per_rank, case_set, dtype, heads, head_dim)
    rows = [{"case": c.summary(), "verdict": "refused"} for c in refused]
    worst_rc = 2 if not cases else 0
    with RankPool(
        max(c.pool_size for c in cases) if cases else 1, placement=Placement(device, stage_p2p=True)
    ) as pool:
        killed = 0  # cases in a row whose ranks died of a signal
        for c in cases:
            if killed >= SIGNAL_DEATHS:
                rows.append(
                    {
                        "case": c.summary(),
                        "verdict": "not run",
                        "detail": f"the ranks were killed by a signal in the {killed} cases before",
                    }
                )
                continue
            t0 = time.perf_counter()
            r = run_case(c, pool, impl, allow_import=registry.is_module_path(impl))
            killed = (
                killed + 1
                if r.dead and all("killed by signal" in d for d in r.dead.values())
                else 0
            )
            row = _case_row(c, r, time.perf_counter() - t0)
            rows.append(row)
            print(
                f"{row['verdict']:18} {row['seconds']:7.2f} s  {row['case']}  "
                f"{row['worst_ratio']}" + (f"  {row['detail'][:160]}" if row["detail"] else ""),
                flush=True,
            )
            if not r.passed:
                worst_rc = 1
    Path(out).write_text(json.dumps(rows, indent=1))
    return worst_rc


def _adapted_cases(
    impl: str,
    worlds: list[int],
    tokens_per_rank: int,
    case_set: str,
    dtype: str,
    heads: int,
    head_dim: int,
) -> tuple[list, list]:
    """The cases of `case_set` at each ring size, adapted to what `impl` declares: those it runs,
    and those it refuses."""
    from harness import case as case_mod
    from harness.impls import registry
    from harness.impls.capabilities import adapt

    caps = registry.resolve(impl, allow_import=registry.is_module_path(impl)).capabilities
    cases, refused = [], []
    for w in worlds:
        for layout, mask in CASE_SETS[case_set]:
            c = case_mod.make_case(
                world_size=w,
                total_len=w * tokens_per_rank,
                layout=layout,
                mask={"kind": mask},
                dtype=dtype,
                heads_q=heads,
                heads_kv=heads,
                head_dim=head_dim,
                seed=w,
                impl=impl,
                deadline_s=240.0,
            )
            a = adapt(caps, c)
            (cases if a is not None else refused).append(a if a is not None else c)
    return cases, refused


def _case_row(c, r, seconds: float) -> dict:
    """The report's row of one judged case: verdict, seconds, worst ratios, what went wrong."""
    return {
        "case": c.summary(),
        "verdict": str(r.verdict),
        "seconds": round(seconds, 2),
        "worst_ratio": {t: round(v, 4) for t, v in r.to_dict()["worst_ratio"].items()},
        "detail": r.detail[:300],
        "errors": {str(k): v[:300] for k, v in r.errors.items()},
        "dead": {str(k): v[:700] for k, v in r.dead.items()},
        "forward_s": r.timings.get("forward_s"),
        "backward_s": r.timings.get("backward_s"),
    }


PROBES = (
    "isend-irecv",
    "all_gather",
    "all_gather_into_tensor",
    "funcol.all_gather_tensor",
    "all_to_all_single",
    "funcol.all_to_all_single",
    "broadcast",
    "all_reduce",
    "reduce_scatter_tensor",
    "funcol.reduce_scatter_tensor",
    "barrier",
    "staged funcol.all_gather_tensor",
    "staged funcol.reduce_scatter_tensor",
)
# With CUDA tensors the harness never hands these to gloo raw: P2P and funcol's
# all-gather/reduce-scatter go through staging (harness.faults.staging). Their probes describe gloo;
# they do not decide the step.
STAGED_ON_CUDA = frozenset(
    {"isend-irecv", "funcol.all_gather_tensor", "funcol.reduce_scatter_tensor"}
)


def probe_relied_on(name: str, device: str) -> bool:
    """Whether ring-harness runs this op as probed with `device` tensors (so a wrong answer fails
    the step)."""
    return device != "cuda" or name not in STAGED_ON_CUDA


def probe_one(name: str, rank: int, store: str, device: str) -> int:
    """One collective on two gloo ranks with tensors on `device`; exit 0 right, 3 wrong (a signal:
    it crashed)."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, 2),
        rank=rank,
        world_size=2,
        timeout=dt.timedelta(seconds=20),
    )
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    # with the CUDA kernel the pool's ranks install (harness.faults.staging)
    if name.startswith("staged "):
        from harness.faults.staging import stage_functional_collectives

        stage_functional_collectives(dev)
        name = name.removeprefix("staged ")
    got, want = _probe_op(name, rank, dev)
    if device == "cuda":
        torch.cuda.synchronize()
    ok = torch.equal(got.cpu(), want.cpu())
    print(
        f"rank {rank}: {name} on {dev}: "
        f"{'right' if ok else f'wrong {got.tolist()} != {want.tolist()}'}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if ok else 3


def _probe_op(name: str, rank: int, dev):
    """Run the op `name` on this rank's tensor: what it gave and what it should give."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(4.0, device=dev) + 10 * rank
    both = torch.cat([torch.arange(4.0) + 10 * r for r in range(2)]).to(dev)
    if name == "isend-irecv":
        got = torch.empty(4, device=dev)
        works = [dist.isend(x, 1 - rank), dist.irecv(got, 1 - rank)]
        for w in works:
            w.wait()
        want = torch.arange(4.0, device=dev) + 10 * (1 - rank)
    elif name == "all_gather":
        parts = [torch.empty(4, device=dev) for _ in range(2)]
        dist.all_gather(parts, x)
        got, want = torch.cat(parts), both
    elif name == "all_gather_into_tensor":
        got = torch.empty(8, device=dev)
        dist.all_gather_into_tensor(got, x)
        want = both
    elif name == "funcol.all_gather_tensor":
        got = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        got, want = torch.as_tensor(got.wait() if hasattr(got, "wait") else got), both
    elif name == "all_to_all_single":
        got = torch.empty(4, device=dev)
        dist.all_to_all_single(got, x)
        want = torch.cat([x.new_tensor([0.0, 1.0]) + 10 * r + 2 * rank for r in range(2)])
    elif name == "funcol.all_to_all_single":
        got = funcol.all_to_all_single(x, [2, 2], [2, 2], dist.group.WORLD)
        got = torch.as_tensor(got.wait() if hasattr(got, "wait") else got)
        want = torch.cat([x.new_tensor([0.0, 1.0]) + 10 * r + 2 * rank for r in range(2)])
    elif name == "broadcast":
        got = x.clone()
        dist.broadcast(got, 0)
        want = torch.arange(4.0, device=dev)
    elif name == "all_reduce":
        got = x.clone()
        dist.all_reduce(got)
        want = 2 * torch.arange(4.0, device=dev) + 10
    elif name == "reduce_scatter_tensor":
        got = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(got, x)
        want = 2 * torch.arange(4.0, device=dev)[2 * rank : 2 * rank + 2] + 10
    elif name == "funcol.reduce_scatter_tensor":
        got = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
        got = torch.as_tensor(got.wait() if hasattr(got, "wait") else got)
        want = 2 * torch.arange(4.0, device=dev)[2 * rank : 2 * rank + 2] + 10
    else:
        dist.barrier()
        got = want = x
    return got, want


def probe_collectives(device: str, out: str, timeout_s: float = 45.0) -> int:
    """Every probe at once, each on its own two gloo ranks: what gloo does with `device` tensors
    here."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="gpu-check-probe-")
    runs = {name: _start_probe(name, device, tmp) for name in PROBES}
    deadline = time.monotonic() + timeout_s
    rows, rc = [], 0
    for name, procs in runs.items():
        outs = [_finish_probe(p, deadline) for p in procs]
        verdict = _probe_verdict([c for c, _ in outs])
        last = " / ".join((t.strip().splitlines() or [""])[-1][:200] for _, t in outs)
        relied = probe_relied_on(name, device)
        rows.append(
            {
                "case": f"{name}, 2 gloo ranks, {device} tensors",
                "verdict": verdict,
                "detail": last,
                "relied_on": relied,
            }
        )
        note = "" if relied else "  (staged by the harness: describes gloo only)"
        print(f"{name:28} {verdict:24} {last[:200]}{note}", flush=True)
        rc = rc if verdict == "right" or not relied else 1
    right = sum(r["verdict"] == "right" for r in rows)
    bad = [r["case"].split(",")[0] for r in rows if r["relied_on"] and r["verdict"] != "right"]
    print(
        f"probes: {right}/{len(rows)} right; "
        + (
            f"relied on and not right: {', '.join(bad)}"
            if bad
            else "every op ring-harness relies on is right"
        ),
        flush=True,
    )
    Path(out).write_text(json.dumps(rows, indent=1))
    return rc


def _start_probe(name: str, device: str, tmp: str) -> list[subprocess.Popen]:
    """Start the probe `name` on two gloo ranks, each a subprocess of its own session."""
    store = os.path.join(tmp, name.replace(".", "-").replace(" ", "-"))
    return [
        subprocess.Popen(
            [
                PY,
                str(SCRIPT),
                "--probe",
                name,
                "--probe-rank",
                str(r),
                "--probe-store",
                store,
                "--device",
                device,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        for r in range(2)
    ]


def _finish_probe(p: subprocess.Popen, deadline: float) -> tuple[int | None, str]:
    """A probe rank's exit status (None: hung, killed at the deadline) and its output."""
    try:
        text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        signal_group(p, signal.SIGKILL)
        text, _ = p.communicate()
        p.returncode = None
    return p.returncode, text or ""


def _probe_verdict(codes: list[int | None]) -> str:
    """What the two ranks' exit statuses say: right, hung, crashed, wrong result, or error."""
    if all(c == 0 for c in codes):
        return "right"
    if any(c is None for c in codes):
        return "hung"
    if any(c is not None and c < 0 for c in codes):
        return (
            "crashed ("
            + ", ".join(signal.Signals(-c).name for c in codes if c is not None and c < 0)
            + ")"
        )
    if any(c == 3 for c in codes):
        return "wrong result"
    return f"error (exit {codes})"


def group_alive(p: subprocess.Popen) -> bool:
    """Whether a process of the group `p` led is still running (after `p` itself has ended)."""
    try:
        os.killpg(p.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group `p` leads, if it is still there."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
