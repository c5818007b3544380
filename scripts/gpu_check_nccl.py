"""The NCCL steps of scripts/gpu_check.py and the smoke script they run under torchrun.

NCCL at W = 1, NCCL's own two-ranks-per-GPU opt-in, and each rank its own NCCL host on one GPU
(issue #45). docs/gpu.md says what has run.
"""

from __future__ import annotations

from pathlib import Path

from gpu_check_common import Step, cuda_only, torchrun
from gpu_check_steps import SCRIPT, nccl_at_least

# Asks the NCCL smoke script to give each rank its own NCCL host (issue #45).
HOSTID_ENV = "SMOKE_HOSTID_PER_RANK"


def per_rank_nccl_env(local_rank: int, environ: dict[str, str]) -> dict[str, str]:
    """What one rank sets before NCCL starts, so that NCCL takes it for a node of its own.

    NCCL folds NCCL_HOSTID into the host hash its duplicate-GPU check compares. With one ID per
    rank, two ranks on one GPU look like two nodes. NCCL then connects them over sockets on
    loopback. Nothing is set unless HOSTID_ENV asks for it.
    """
    if not environ.get(HOSTID_ENV):
        return {}
    return {
        "NCCL_HOSTID": f"ring-harness-rank-{local_rank}",
        "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", "lo"),
    }


# The smoke script imports per_rank_nccl_env from this folder (SCRIPTS_DIR is filled in).
SMOKE = r"""
import os, sys
sys.path.insert(0, "@SCRIPTS_DIR@")
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
    smoke.parent.mkdir(parents=True, exist_ok=True)
    smoke.write_text(SMOKE.replace("@SCRIPTS_DIR@", str(SCRIPT.parent)))
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
