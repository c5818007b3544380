"""The NCCL steps of scripts/gpu_check.py and the smoke script they run under torchrun.

NCCL at W = 1, NCCL's own two-ranks-per-GPU opt-in, and each rank its own NCCL host on one GPU
(issue #45). docs/gpu.md says what has run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpu_check_common import Step, cuda_only, torchrun, torchrun_check
from gpu_check_steps import SCRIPT, nccl_at_least

if str(SCRIPT.parents[1]) not in sys.path:  # a plain checkout: harness is not installed
    sys.path.insert(0, str(SCRIPT.parents[1]))
from harness.ranks.backend import nccl_host_per_rank  # noqa: E402

# Asks the NCCL smoke script to give each rank its own NCCL host (issue #45).
HOSTID_ENV = "SMOKE_HOSTID_PER_RANK"


def per_rank_nccl_env(local_rank: int, environ: dict[str, str]) -> dict[str, str]:
    """What one smoke rank sets before NCCL starts: `--share-gpu`'s environment, if HOSTID_ENV asks."""
    if not environ.get(HOSTID_ENV):
        return {}
    return nccl_host_per_rank(local_rank, environ)


# The smoke script imports per_rank_nccl_env from this folder (SCRIPTS_DIR is filled in).
SMOKE = r"""
import os, sys
sys.path.insert(0, "@SCRIPTS_DIR@")
sys.path.insert(0, "@ROOT@")
from gpu_check_nccl import per_rank_nccl_env
os.environ.update(per_rank_nccl_env(int(os.environ["LOCAL_RANK"]), dict(os.environ)))
import torch, torch.distributed as dist
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
    g = [torch.empty(2, device="cuda") for _ in range(w)]
    dist.all_gather(g, torch.full((2,), float(r), device="cuda"))
    assert [t[0].item() for t in g] == [float(i) for i in range(w)], g
torch.cuda.synchronize()
host = os.environ.get("NCCL_HOSTID", "-")
ops = "all_reduce, ring send/recv and all_gather" if w > 1 else "all_reduce"
print(f"rank {r}/{w}: nccl {ops} ok on cuda:{torch.cuda.current_device()} (NCCL_HOSTID {host})")
dist.destroy_process_group()
"""


def nccl_steps(device: str, out: Path, facts: dict) -> list[Step]:
    """NCCL itself: at W = 1, and two ranks on one GPU where NCCL allows it. Writes the smoke
    script."""
    no_cuda = cuda_only(device)
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
            torchrun(2, str(smoke)),
            45,
            skip=mr_skip,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "1", "SMOKE_GPU": "0"},
        )
    )
    steps.append(
        Step(
            "nccl-smoke-w1",
            "NCCL itself at W = 1 (init, all_reduce) before the harness's torchrun step",
            torchrun(1, str(smoke)),
            45,
            skip=no_cuda,
        )
    )
    steps += _hostid_steps(smoke, no_cuda)
    steps += shared_gpu_steps(out, no_cuda)
    smoke.parent.mkdir(parents=True, exist_ok=True)
    smoke.write_text(
        SMOKE.replace("@SCRIPTS_DIR@", str(SCRIPT.parent)).replace("@ROOT@", str(SCRIPT.parents[1]))
    )
    return steps


# Each rank its own NCCL host on one GPU (issue #45): NCCL_DEBUG=INFO keeps NCCL's own account in
# the step's log. The second form turns off every transport but sockets, if the first fails.
HOSTID_BASE = {HOSTID_ENV: "1", "SMOKE_GPU": "0", "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO"}
SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket"}


def _hostid_steps(smoke: Path, no_cuda: str) -> list[Step]:
    """Two, then four ranks on cuda:0, each with its own NCCL_HOSTID, over loopback sockets."""
    what = "ranks on cuda:0, each its own NCCL_HOSTID (a node to NCCL), sockets on lo"
    return [
        Step(
            "nccl-hostid-w2",
            f"2 {what}",
            torchrun(2, str(smoke)),
            40,
            skip=no_cuda,
            env=dict(HOSTID_BASE),
        ),
        Step(
            "nccl-hostid-w2-sockets",
            f"2 {what}; P2P, SHM off, NCCL_NET=Socket",
            torchrun(2, str(smoke)),
            40,
            skip=no_cuda,
            env={**HOSTID_BASE, **SOCKETS_ONLY},
        ),
        Step(
            "nccl-hostid-w4",
            f"4 {what}",
            torchrun(4, str(smoke)),
            40,
            skip=no_cuda,
            env=dict(HOSTID_BASE),
        ),
    ]


# The check under `--share-gpu` (issue #45): NCCL's warnings only, its INFO is in the smoke steps.
SHARED_ENV = {"NCCL_DEBUG": "WARN"}
# name, W, what, extra check flags, time limit (s); the three broken rings expect exit 1 (torchrun's)
SHARED_CHECKS = [
    (
        "nccl-shared-check-w2",
        2,
        "the reference's default check: battery, fault stage (delay, early-read, send-reuse), "
        "5 property-based examples",
        ["--fault-stage", "delay,early-read,send-reuse", "--max-examples", "5", "--no-scale"],
        120,
    ),
    (
        "nccl-shared-check-w4",
        4,
        "the reference's default check, as at W = 2",
        ["--fault-stage", "delay,early-read,send-reuse", "--max-examples", "5", "--no-scale"],
        150,
    ),
    (
        "nccl-shared-torch-cp",
        2,
        "torch's context_parallel (SDPA, allgather rotation): battery, fault stage",
        ["--impl", "torch-cp", "--max-examples", "0", "--no-scale"],
        120,
    ),
    (
        "nccl-shared-raise",
        2,
        "rank 1 raises as rank 0 waits on it: a fail-stop naming rank 1",
        ["--impl", "tests.helpers.impls:raise_on_rank1", "--max-examples", "0", "--deadline", "20"],
        60,
    ),
    (
        "nccl-shared-hang",
        2,
        "rank 1 never enters the ring: the watchdog names the rank and ends the job (exit 124)",
        ["--impl", "tests.helpers.impls:hang_on_rank1", "--max-examples", "0", "--deadline", "10"],
        60,
    ),
    (
        "nccl-shared-signal",
        2,
        "rank 1 is killed by SIGKILL as rank 0 waits on it: reported, nothing left running",
        [
            "--impl",
            "tests.helpers.impls:killed_on_rank1",
            "--max-examples",
            "0",
            "--deadline",
            "20",
        ],
        60,
    ),
]


# One fault kind at a time: which of them the fault stage's NCCL timeouts come from.
SHARED_CHECKS += [
    (
        f"nccl-shared-faults-{kind}",
        2,
        f"the fault stage with {kind} alone, battery before it",
        ["--fault-stage", kind, "--max-examples", "0", "--no-scale", "--maxfail", "3"],
        60,
    )
    for kind in ("delay", "early-read", "send-reuse")
]


BROKEN = ("nccl-shared-raise", "nccl-shared-hang", "nccl-shared-signal")


def shared_check_command(world_size: int, flags: list[str], out: Path, name: str) -> list[str]:
    """`check` under torchrun with NCCL, every rank on the visible GPUs (`--share-gpu`)."""
    return torchrun_check(
        world_size,
        "--share-gpu",
        "--no-growth",
        "--no-repeat",
        *flags,
        "--json",
        str(out / "steps" / f"{name}.json"),
        "--save-dir",
        str(out / f"failures-{name}"),
    )


def shared_gpu_steps(out: Path, no_cuda: str) -> list[Step]:
    """The check at W = 2 and 4 with every NCCL rank on one GPU, and three ways a rank fails."""
    return [
        Step(
            name,
            f"W = {w}, NCCL, --share-gpu: {what}",
            shared_check_command(w, flags, out, name),
            limit,
            min_s=40,
            skip=no_cuda,
            env=dict(SHARED_ENV),
            json=str(out / "steps" / f"{name}.json"),
            expect=(1,) if name in BROKEN else (0,),
        )
        for name, w, what, flags, limit in SHARED_CHECKS
    ]
