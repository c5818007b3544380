"""What every step of scripts/gpu_check.py is made of: the Step, and commands they share."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_check_steps import PY


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
    # exit statuses that mean the step showed what it should (a broken ring's step exits non-zero)
    expect: tuple[int, ...] = (0,)


def cuda_only(device: str) -> str:
    """Why a CUDA-only step does not apply ('' on cuda)."""
    return "" if device == "cuda" else "CUDA only: run with --device cuda on a GPU host"


def torchrun(nproc: int, *args: str) -> list[str]:
    """A command under torchrun with `nproc` ranks on this host."""
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *args,
    ]


def torchrun_check(world_size: int, *flags: str) -> list[str]:
    """`harness check` under torchrun with NCCL, `world_size` ranks on this host, then `flags`."""
    return torchrun(
        world_size,
        "-m",
        "harness",
        "check",
        "--launcher",
        "torchrun",
        "--backend",
        "nccl",
        "--world-size",
        str(world_size),
        *flags,
    )
