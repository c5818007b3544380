"""Backend and device choice, in one place: gloo on CPU here, NCCL on cuda:LOCAL_RANK under torchrun."""

from __future__ import annotations

import os

import torch


def choose_backend(requested: str | None = None) -> str:
    """'gloo' or 'nccl'. Default: nccl when launched by torchrun with CUDA, else gloo."""
    if requested:
        if requested not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {requested!r}; expected gloo or nccl")
        return requested
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def device_for(backend: str) -> torch.device:
    """CPU for gloo; cuda:LOCAL_RANK for nccl (one rank per GPU)."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")
