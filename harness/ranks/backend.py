"""Backend and device choice, in one place: gloo on CPU here, NCCL on cuda:LOCAL_RANK under
torchrun, or gloo ranks sharing the visible GPUs with P2P staged through host buffers
(`Placement`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from harness.errors import HarnessError

DEVICES = ("cpu", "cuda")
DEVICE_ENV = "RING_HARNESS_DEVICE"  # the pool's default device: cpu or cuda
STAGE_ENV = "RING_HARNESS_STAGE_P2P"  # 1: stage P2P through host buffers on CPU too


@dataclass(frozen=True)
class Placement:
    """Where a local pool's ranks compute and how their P2P travels.

    device "cuda": rank r runs on cuda:(r mod visible GPUs), on gloo, its P2P staged through pinned
    host buffers (harness.faults.staging). `stage_p2p`: the same staging on CPU tensors, so CI runs
    that code."""

    device: str = "cpu"
    stage_p2p: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"unknown device {self.device!r}; expected one of {', '.join(DEVICES)}"
            )

    @property
    def staged(self) -> bool:
        return self.device == "cuda" or self.stage_p2p

    @classmethod
    def from_env(cls) -> Placement:
        """$RING_HARNESS_DEVICE and $RING_HARNESS_STAGE_P2P, else CPU without staging."""
        return cls(
            os.environ.get(DEVICE_ENV) or "cpu", os.environ.get(STAGE_ENV, "") not in ("", "0")
        )

    def describe(self) -> str:
        if self.device == "cuda":
            return "cuda, P2P staged through pinned host memory"
        return "cpu, P2P staged through host buffers" if self.stage_p2p else "cpu"


def placement_of(device: str | None, stage_p2p: bool = False) -> Placement:
    """The local pool's device and staging: the options over the environment's defaults."""
    env = Placement.from_env()
    return Placement(device or env.device, stage_p2p or env.stage_p2p)


def require_cuda(flag: str) -> None:
    """One clear line (HarnessError) when `flag` asks for CUDA and this torch sees none."""
    if not torch.cuda.is_available():
        build = "a CPU build: install a CUDA build" if torch.version.cuda is None else "no GPU seen"
        raise HarnessError(
            f"{flag}: this torch sees no CUDA device (torch {torch.__version__}, {build})"
        )


def rank_device(placement: Placement, rank: int) -> torch.device:
    """The device of pool rank `rank`: the CPU, or cuda:(rank mod visible GPUs), made current."""
    if placement.device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def choose_backend(requested: str | None = None) -> str:
    """'gloo' or 'nccl'. Default: nccl when launched by torchrun with CUDA, else gloo."""
    if requested:
        if requested not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {requested!r}; expected gloo or nccl")
        return requested
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def device_for(backend: str, share_gpu: bool = False) -> torch.device:
    """CPU for gloo; cuda:LOCAL_RANK for nccl (one rank per GPU).

    `share_gpu`: each rank takes cuda:(LOCAL_RANK mod visible GPUs), so W ranks fit on fewer GPUs.
    """
    if backend != "nccl":
        return torch.device("cpu")
    require_cuda("NCCL ranks")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if share_gpu:
        local %= count
    elif local >= count:
        raise HarnessError(
            f"rank with LOCAL_RANK {local} has no GPU of its own ({count} visible); "
            "NCCL refuses two ranks on one GPU: add --share-gpu"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def nccl_host_per_rank(rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment that makes NCCL take one rank for a node of its own (`--share-gpu`).

    NCCL folds NCCL_HOSTID into the host hash its duplicate-GPU check compares. With one ID per
    rank, ranks on one GPU look like separate nodes. NCCL then connects them with its socket
    transport, on loopback unless NCCL_SOCKET_IFNAME says otherwise. `rank` is the global rank, so
    IDs differ across nodes too. docs/gpu.md has what ran.
    """
    return {
        "NCCL_HOSTID": f"ring-harness-rank-{rank}",
        "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", "lo"),
    }
