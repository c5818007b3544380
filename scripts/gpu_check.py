"""The prepared GPU validation (issue #32): every CUDA path of ring-harness, each step bounded, one report.

    python scripts/gpu_check.py --out DIR [--device cuda|cpu] [--budget SECONDS]

Runs from a plain checkout (no pip install: the checkout is put on the path). Each step is a subprocess
with its own time limit (SIGTERM, then SIGKILL of its process group), so one hang cannot eat the rest;
a step that would start with less than its minimum of the budget left is skipped. Writes DIR/report.md
and DIR/report.json (every step: outcome, seconds, what it ran, a summary), DIR/steps/*.log, and all of DIR as
DIR.tar.gz.
`--device cpu` runs the same steps on CPU gloo ranks with P2P staging forced; the CUDA-only ones are
reported as skipped. Outcomes: passed, failed (the ring is wrong: exit 1), refused (exit 2), error (any
other exit), timed out, skipped. Exit 0 when no step failed, errored or timed out, else 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PY = sys.executable
TERM_GRACE_S = 10.0  # a step's time to write its partial report after SIGTERM


@dataclass
class Step:
    """One bounded step: a command, its time limit, the least budget it needs to start, and when it applies."""

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


# -- the steps' own code (run as `gpu_check.py --env` / `--cases`, in a subprocess) ---------------------------
def env_facts() -> dict:
    """torch, CUDA, NCCL, the devices, and whether MPS and NCCL's multi-rank-per-GPU opt-in could apply."""
    import torch
    import torch.distributed as dist

    facts: dict = {"python": platform.python_version(), "torch": torch.__version__,
                   "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                   "gloo": dist.is_available() and dist.is_gloo_available(),
                   "nccl_available": dist.is_available() and dist.is_nccl_available(), "host_cpus": os.cpu_count()}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        facts["gpus"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                          "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                          "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                         for i in range(n)]
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # no NCCL in this build
            facts["nccl"] = f"unknown ({type(e).__name__})"
    facts["mps_pipe"] = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or (
        "/tmp/nvidia-mps" if os.path.exists("/tmp/nvidia-mps") else "")
    for mod in ("flash_attn", "transformer_engine", "triton", "hypothesis", "yaml", "numpy", "deepspeed",
                "transformers"):
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


SIGNAL_DEATHS = 2  # cases in a row whose ranks die of a signal before an adapter's remaining cases are not run
CASE_SETS = {
    # (layout, mask): the basics a CP implementation is used with; adapted to what the impl declares
    "basic": (("contiguous", "none"), ("zigzag", "causal"), ("contiguous", "causal")),
    "long": (("zigzag", "causal"),),
}


def run_cases(impl: str, worlds: list[int], device: str, tokens_per_rank: int, case_set: str, dtype: str,
              heads: int, head_dim: int, out: str) -> int:
    """Run a few cases of `impl` at each ring size in `worlds` on one pool and judge them with the float64
    oracle computed by the ranks on their device. Exit 0 all passed, 1 one failed, 2 none could run. After
    SIGNAL_DEATHS cases in a row whose ranks were killed by a signal, the rest are not run (each costs a restart
    of a GPU host's scarce minutes and would die the same way)."""
    from harness import case as case_mod
    from harness.impls import registry
    from harness.impls.capabilities import adapt
    from harness.ranks.backend import Placement
    from harness.ranks.pool import RankPool
    from harness.runner import run_case

    caps = registry.resolve(impl, allow_import=registry.is_module_path(impl)).capabilities
    cases, refused = [], []
    for w in worlds:
        for layout, mask in CASE_SETS[case_set]:
            c = case_mod.make_case(world_size=w, total_len=w * tokens_per_rank, layout=layout,
                                   mask={"kind": mask}, dtype=dtype, heads_q=heads, heads_kv=heads,
                                   head_dim=head_dim, seed=w, impl=impl, deadline_s=240.0)
            a = adapt(caps, c)
            (cases if a is not None else refused).append(a if a is not None else c)
    rows = [{"case": c.summary(), "verdict": "refused"} for c in refused]
    worst_rc = 2 if not cases else 0
    with RankPool(max(c.pool_size for c in cases) if cases else 1,
                  placement=Placement(device, stage_p2p=True)) as pool:
        killed = 0  # cases in a row whose ranks died of a signal
        for c in cases:
            if killed >= SIGNAL_DEATHS:
                rows.append({"case": c.summary(), "verdict": "not run",
                             "detail": f"the ranks were killed by a signal in the {killed} cases before"})
                continue
            t0 = time.perf_counter()
            r = run_case(c, pool, impl, allow_import=registry.is_module_path(impl))
            killed = killed + 1 if r.dead and all("killed by signal" in d for d in r.dead.values()) else 0
            row = {"case": c.summary(), "verdict": str(r.verdict), "seconds": round(time.perf_counter() - t0, 2),
                   "worst_ratio": {t: round(v, 4) for t, v in r.to_dict()["worst_ratio"].items()},
                   "detail": r.detail[:300], "errors": {str(k): v[:300] for k, v in r.errors.items()},
                   "dead": {str(k): v[:700] for k, v in r.dead.items()},
                   "forward_s": r.timings.get("forward_s"), "backward_s": r.timings.get("backward_s")}
            rows.append(row)
            print(f"{row['verdict']:18} {row['seconds']:7.2f} s  {row['case']}  {row['worst_ratio']}"
                  + (f"  {row['detail'][:160]}" if row["detail"] else ""), flush=True)
            if not r.passed:
                worst_rc = 1
    Path(out).write_text(json.dumps(rows, indent=1))
    return worst_rc


PROBES = ("isend-irecv", "all_gather", "all_gather_into_tensor", "funcol.all_gather_tensor", "all_to_all_single",
          "funcol.all_to_all_single", "broadcast", "all_reduce", "reduce_scatter_tensor",
          "funcol.reduce_scatter_tensor", "barrier", "staged funcol.all_gather_tensor",
          "staged funcol.reduce_scatter_tensor")
# With CUDA tensors the harness never hands these to gloo raw: P2P and funcol's all-gather/reduce-scatter
# go through staging (harness.faults.staging). Their probes describe gloo; they do not decide the step.
STAGED_ON_CUDA = frozenset({"isend-irecv", "funcol.all_gather_tensor", "funcol.reduce_scatter_tensor"})


def probe_relied_on(name: str, device: str) -> bool:
    """Whether ring-harness runs this op as probed with `device` tensors (so a wrong answer fails the step)."""
    return device != "cuda" or name not in STAGED_ON_CUDA


def probe_one(name: str, rank: int, store: str, device: str) -> int:
    """One collective on two gloo ranks with tensors on `device`; exit 0 right, 3 wrong (a signal: it crashed)."""
    import datetime as dt

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=20))
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if name.startswith("staged "):  # with the CUDA kernel the pool's ranks install (harness.faults.staging)
        from harness.faults.staging import stage_functional_collectives

        stage_functional_collectives(dev)
        name = name.removeprefix("staged ")
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
        want = 2 * torch.arange(4.0, device=dev)[2 * rank:2 * rank + 2] + 10
    elif name == "funcol.reduce_scatter_tensor":
        got = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
        got = torch.as_tensor(got.wait() if hasattr(got, "wait") else got)
        want = 2 * torch.arange(4.0, device=dev)[2 * rank:2 * rank + 2] + 10
    else:
        dist.barrier()
        got = want = x
    if device == "cuda":
        torch.cuda.synchronize()
    ok = torch.equal(got.cpu(), want.cpu())
    print(f"rank {rank}: {name} on {dev}: {'right' if ok else f'wrong {got.tolist()} != {want.tolist()}'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 3


def probe_collectives(device: str, out: str, timeout_s: float = 45.0) -> int:
    """Every probe at once, each on its own two gloo ranks: what gloo does with `device` tensors here."""
    import tempfile

    me = Path(__file__).resolve()
    runs = {}
    tmp = tempfile.mkdtemp(prefix="gpu-check-probe-")
    for name in PROBES:
        store = os.path.join(tmp, name.replace(".", "-").replace(" ", "-"))
        runs[name] = [subprocess.Popen([PY, str(me), "--probe", name, "--probe-rank", str(r), "--probe-store", store,
                                        "--device", device], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True, text=True) for r in range(2)]
    deadline = time.monotonic() + timeout_s
    rows, rc = [], 0
    for name, procs in runs.items():
        outs = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                text, _ = p.communicate()
                p.returncode = None
            outs.append((p.returncode, text or ""))
        codes = [c for c, _ in outs]
        if all(c == 0 for c in codes):
            verdict = "right"
        elif any(c is None for c in codes):
            verdict = "hung"
        elif any(c is not None and c < 0 for c in codes):
            verdict = "crashed (" + ", ".join(signal.Signals(-c).name for c in codes if c is not None and c < 0) + ")"
        elif any(c == 3 for c in codes):
            verdict = "wrong result"
        else:
            verdict = f"error (exit {codes})"
        last = " / ".join((t.strip().splitlines() or [""])[-1][:200] for _, t in outs)
        relied = probe_relied_on(name, device)
        rows.append({"case": f"{name}, 2 gloo ranks, {device} tensors", "verdict": verdict, "detail": last,
                     "relied_on": relied})
        note = "" if relied else "  (staged by the harness: describes gloo only)"
        print(f"{name:28} {verdict:24} {last[:200]}{note}", flush=True)
        rc = rc if verdict == "right" or not relied else 1
    right = sum(r["verdict"] == "right" for r in rows)
    bad = [r["case"].split(",")[0] for r in rows if r["relied_on"] and r["verdict"] != "right"]
    print(f"probes: {right}/{len(rows)} right; " + (f"relied on and not right: {', '.join(bad)}" if bad else
          "every op ring-harness relies on is right"), flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))
    return rc


SMOKE = r'''
import os, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ.get("SMOKE_GPU", os.environ["LOCAL_RANK"])))
dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
x = torch.full((4,), float(r + 1), device="cuda")
dist.all_reduce(x)
assert x.tolist() == [w * (w + 1) / 2] * 4, x
if w > 1:
    y = torch.full((3,), float(r), device="cuda")
    z = torch.empty(3, device="cuda")
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, y, (r + 1) % w), dist.P2POp(dist.irecv, z, (r - 1) % w)])
    for q in reqs:
        q.wait()
    assert z.tolist() == [float((r - 1) % w)] * 3, z
torch.cuda.synchronize()
print(f"rank {r}/{w}: nccl all_reduce{' and ring send/recv' if w > 1 else ''} ok on cuda:{torch.cuda.current_device()}")
dist.destroy_process_group()
'''


# -- planning and running the steps ----------------------------------------------------------------------
def plan(device: str, out: Path, facts: dict) -> list[Step]:
    cuda = device == "cuda"
    gpus = len(facts.get("gpus") or [])
    me = [PY, str(Path(__file__).resolve())]
    dev = ["--device", device] + ([] if cuda else ["--stage-p2p"])
    js = lambda name: str(out / "steps" / f"{name}.json")  # noqa: E731
    check = [PY, "-m", "harness", "check", *dev]
    no_cuda = "" if cuda else "CUDA only: run with --device cuda on a GPU host"
    cases = lambda name, impl, worlds, **kw: me + [  # noqa: E731
        "--cases", impl, "--worlds", worlds, "--device", device, "--json-out", js(name),
        *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    steps = [
        Step("gloo-collectives", "what gloo does with the device's tensors: each P2P op and collective the rings "
             "use, on two gloo ranks (right, wrong, error, crashed, hung)",
             me + ["--probe-collectives", "--device", device, "--json-out", js("gloo-collectives")], 60,
             json=js("gloo-collectives")),
        Step("reference-cases", "the reference ring at W = 1, 2, 4, 8 (contiguous/zigzag, none/causal, bf16, "
             "h4 d64, 256 tokens a rank), oracle on the ranks' devices",
             cases("reference-cases", "reference", "1,2,4,8"), 90, json=js("reference-cases")),
        Step("torch-cp", "torch's context_parallel (SDPA flash/efficient, allgather rotation) at W = 2, 4 with "
             "backward", cases("torch-cp", "torch-cp", "2,4"), 75, skip=no_cuda, json=js("torch-cp")),
        Step("torch-cp-alltoall", "torch's context_parallel, alltoall rotation, at W = 2, 4 with backward",
             cases("torch-cp-alltoall", "torch-cp-alltoall", "2,4"), 75, skip=no_cuda, json=js("torch-cp-alltoall")),
        Step("torch-flex-cp", "flex attention under torch's CP (eager) at W = 2, 4 with backward",
             cases("torch-flex-cp", "torch-flex-cp", "2,4"), 75, skip=no_cuda, json=js("torch-flex-cp")),
        Step("torch-flex-cp-compiled", "flex attention compiled (Triton) under torch's CP at W = 2, 4, backward",
             cases("torch-flex-cp-compiled", "torch-flex-cp-compiled", "2,4"), 120, min_s=40, skip=no_cuda,
             json=js("torch-flex-cp-compiled")),
        Step("long-32k" if cuda else "long-4k",
             "one 32,768-token zigzag causal bf16 case at W = 8, judged with the float64 oracle on the GPU" if cuda
             else "one 4,096-token case at W = 8 (32k on CPU takes too long here), oracle on the ranks",
             cases("long", "reference", "8", tokens_per_rank=4096 if cuda else 512, case_set="long"), 120, min_s=30,
             json=js("long")),
        Step("check", "the default check of the reference at --world-size 8: battery (W = 1, 2, 3, 4, 8), scale "
             "stage, growth check, fault stage (early-read, send-reuse), 10 property-based examples",
             check + ["--world-size", "8", "--max-examples", "10", "--json", js("check"),
                      "--save-dir", str(out / "failures")], 180, min_s=60, json=js("check")),
        Step("selftest-subset", "the selftest's fast subset (one mutant per stage) on the device",
             [PY, "-m", "harness", "selftest", *dev, "--only",
              "naive-merge-sum,out-merge-in-input-dtype,tile-tail-dropped,read-before-wait",
              "--json", js("selftest"), "--save-dir", str(out / "selftest")], 180, min_s=60, json=js("selftest")),
        Step("torchrun-nccl-w1", "torchrun with NCCL at W = 1: the check's battery on cuda:LOCAL_RANK, oracle there",
             [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "harness", "check",
              "--launcher", "torchrun", "--backend", "nccl", "--world-size", "1", "--max-examples", "5",
              "--no-growth", "--json", js("torchrun"), "--save-dir", str(out / "failures-torchrun")],
             120, min_s=40, skip=no_cuda, json=js("torchrun")),
        Step("torchrun-nccl-multi", "torchrun with NCCL at W = number of GPUs (> 1)",
             [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(max(gpus, 2)), "-m",
              "harness", "check", "--launcher", "torchrun", "--backend", "nccl", "--world-size", str(max(gpus, 2)),
              "--max-examples", "5", "--no-growth"], 120, min_s=40,
             skip=no_cuda or ("" if gpus >= 2 else f"needs two GPUs; this host has {gpus}")),
    ]
    ds = "" if facts.get("deepspeed") else "deepspeed is not importable here (pip install 'ring-harness[deepspeed]')"
    hf = ds or ("" if facts.get("transformers") else "transformers is not importable here (ALST's attention)")
    for impl in ("deepspeed-ulysses", "deepspeed-ulysses-seqfirst", "deepspeed-alst"):
        steps.append(Step(impl, f"the default check of {impl} (torch's SDPA on the device) without the fault stage: "
                          "battery, scale stage at training sizes, growth and repeat checks, 10 property-based "
                          "examples", check + ["--impl", impl, "--max-examples", "10", "--fault-stage", "none",
                                               "--json", js(impl), "--save-dir", str(out / "failures")],
                          150, min_s=45, skip=hf if impl == "deepspeed-alst" else ds, json=js(impl)))
    steps.append(Step("deepspeed-uneven-length", "DeepSpeed #7384 (S % W != 0) on the device's tensors: the "
                      "corpus case that aborts a rank on CPU gloo", [PY, "-m", "harness", "replay",
                      str(ROOT / "cases" / "deepspeed-ulysses-uneven-length.yaml"), *dev, "--json",
                      js("deepspeed-uneven-length")], 60, skip=ds, json=js("deepspeed-uneven-length")))
    steps.append(Step("deepspeed-fpdt", "the default check of deepspeed-fpdt (flash-attn) without the fault stage",
                      check + ["--impl", "deepspeed-fpdt", "--max-examples", "10", "--fault-stage", "none", "--json",
                               js("deepspeed-fpdt"), "--save-dir", str(out / "failures"),
                               *([] if cuda else ["--no-scale"])], 150, min_s=45,  # CPU: ci/thirdparty-check.sh's why
                      skip=ds or ("" if facts.get("flash_attn") or not cuda else "needs flash-attn on a GPU host"),
                      json=js("deepspeed-fpdt")))
    smoke = out / "steps" / "nccl_smoke.py"
    nccl = facts.get("nccl")
    mr_skip = no_cuda or ("" if nccl_at_least(nccl, (2, 30)) else
                          f"NCCL {nccl} < 2.30 has no NCCL_MULTI_RANK_GPU_ENABLE (it refuses two ranks on one GPU)")
    mps = f"at {facts['mps_pipe']}" if facts.get("mps_pipe") else "not running"
    steps.append(Step("nccl-multi-rank-per-gpu", "NCCL >= 2.30's experimental two ranks on one GPU "
                      f"(NCCL_MULTI_RANK_GPU_ENABLE=1; MPS {mps})",
                      [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(smoke)],
                      45, skip=mr_skip, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1", "SMOKE_GPU": "0"}))
    steps.append(Step("nccl-smoke-w1", "NCCL itself at W = 1 (init, all_reduce) before the harness's torchrun step",
                      [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(smoke)], 45,
                      skip=no_cuda))
    smoke.parent.mkdir(parents=True, exist_ok=True)
    smoke.write_text(SMOKE)
    order = ["gloo-collectives", "reference-cases", "torch-cp", "torch-cp-alltoall", "torch-flex-cp",
             "torch-flex-cp-compiled", "long-32k", "long-4k", "nccl-smoke-w1", "torchrun-nccl-w1",
             "torchrun-nccl-multi",
             "nccl-multi-rank-per-gpu", "check", "selftest-subset", "deepspeed-ulysses",
             "deepspeed-ulysses-seqfirst", "deepspeed-alst", "deepspeed-uneven-length",
             "deepspeed-fpdt"]  # the cheap and never-run first
    return sorted(steps, key=lambda s: order.index(s.name))


def run_step(step: Step, out: Path, left_s: float) -> Outcome:
    """Run one step within min(its limit, the budget left); SIGTERM, then SIGKILL, its process group on time."""
    cmd = " ".join(step.argv)
    if step.skip:
        return Outcome(step.name, step.what, "skipped", 0.0, cmd, summary=step.skip)
    if left_s < step.min_s:
        return Outcome(step.name, step.what, "skipped", 0.0, cmd,
                       summary=f"budget: {left_s:.0f} s left, the step needs at least {step.min_s:.0f} s")
    limit = min(step.timeout_s, left_s)
    log = out / "steps" / f"{step.name}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **step.env)
    env.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(out / "hypothesis"))
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        p = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal(p, signal.SIGTERM)
            try:
                rc = p.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                rc = p.wait()
        _signal(p, signal.SIGKILL)  # anything the step left in its group
    secs = time.monotonic() - t0
    outcome = ("timed out" if timed_out else "passed" if rc == 0 else "failed" if rc == 1
               else "refused" if rc == 2 else "error")
    o = Outcome(step.name, step.what, outcome, round(secs, 1), cmd, rc, log=str(log.relative_to(out)))
    o.summary = _summary(log, timed_out, limit)
    if step.json and os.path.exists(step.json):
        try:
            o.details = _details(json.loads(Path(step.json).read_text()))
        except (OSError, ValueError) as e:
            o.details = {"unreadable": str(e)}
    return o


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _summary(log: Path, timed_out: bool, limit: float) -> str:
    """The step's last telling line(s): a verdict line of the check, or the log's tail."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    keys = ("check PASSED", "check FAILED", "selftest", "killed", "Error", "error:", "ok on cuda", "refused", "probes:")
    telling = [ln for ln in lines if any(k in ln for k in keys)]
    text = " | ".join((telling or lines)[-3:])[:600]
    return (f"stopped at its {limit:.0f}-s limit; " if timed_out else "") + text


def _details(data) -> dict | list:
    """What the report keeps of a step's JSON: per-case rows, or a check's stage outcome in brief."""
    if isinstance(data, list):
        return data
    if not isinstance(data, dict):
        return {}
    keep = {k: data[k] for k in ("passed", "exit", "cases", "failures", "stage_seconds", "stopped", "killed",
                                  "mutants", "interrupted") if k in data}
    if "growth" in data and isinstance(data["growth"], dict):
        keep["growth"] = {k: v for k, v in data["growth"].items() if k in ("passed", "worlds", "verdict", "ratios")}
    return keep


def write_report(out: Path, device: str, facts: dict, outcomes: list[Outcome], started: str, wall: float) -> None:
    gpu = ", ".join(g["name"] for g in facts.get("gpus") or []) or "none"
    report = {"date": started, "device": device, "gpus": gpu, "wall_s": round(wall, 1), "environment": facts,
              "steps": [asdict(o) for o in outcomes]}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    md = [f"# ring-harness GPU check, {started}", "",
          f"- device: `{device}`; GPUs: {gpu}; torch {facts.get('torch')} (CUDA {facts.get('cuda_build')}), "
          f"NCCL {facts.get('nccl', '-')}; {facts.get('host_cpus')} host CPUs",
          f"- command: `python scripts/gpu_check.py --out DIR --device {device}`; wall {wall:.0f} s", "",
          "| step | outcome | seconds | summary |", "|---|---|---:|---|"]
    for o in outcomes:
        md.append(f"| {o.name} | {o.outcome} | {o.seconds:.1f} | {o.summary.replace('|', '/')[:300]} |")
    md += ["", "## What each step ran", ""]
    for o in outcomes:
        md.append(f"- **{o.name}**: {o.what}. `{o.command[:400]}`")
        if isinstance(o.details, list):
            for row in o.details:
                md.append(f"  - {row.get('verdict')}: {row.get('case')} {row.get('worst_ratio', '')} "
                          f"{row.get('detail', '')[:200]} {row.get('errors') or ''} {row.get('dead') or ''}".rstrip())
    (out / "report.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the folder the report goes to (created)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget", type=float, default=600.0, help="seconds for every step together (default 600)")
    p.add_argument("--only", help="comma list of step names to run (the others are reported as skipped)")
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
        return run_cases(a.cases, [int(w) for w in a.worlds.split(",")], a.device, a.tokens_per_rank, a.case_set,
                         "bf16", 4, 64, a.json_out)
    if not a.out:
        p.error("--out DIR is required")
    out = Path(a.out).resolve()
    (out / "steps").mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    env_step = Step("environment", "torch, CUDA and NCCL versions, the devices", [PY, __file__, "--env"], 60)
    first = run_step(env_step, out, a.budget)
    try:
        lines = (out / first.log).read_text().strip().splitlines()
        facts = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        facts = {}
    first.details = facts
    first.summary = (f"torch {facts.get('torch')}, CUDA {facts.get('cuda_build')}, NCCL {facts.get('nccl', '-')}, "
                     f"GPUs: {', '.join(g['name'] for g in facts.get('gpus') or []) or 'none'}")
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
        write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)  # a report even if killed
    write_report(out, a.device, facts, outcomes, started, time.monotonic() - t0)
    bad = [o for o in outcomes if o.outcome in ("failed", "error", "timed out")]
    archive = shutil.make_archive(str(out), "gztar", out.parent, out.name)  # one file: the GPU tool returns few
    print(f"report: {out / 'report.md'} (all of it: {archive}); {len(outcomes)} steps, {len(bad)} failed/errored/"
          f"timed out, {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
