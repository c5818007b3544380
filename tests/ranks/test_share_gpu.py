"""`--share-gpu`: torchrun's NCCL ranks on fewer GPUs, each rank a node of its own to NCCL.

A GPU ran it (docs/gpu.md, issue #45). Here: the environment each rank gets, the device each rank
takes, and the refusals.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.checks.options import CheckOptions
from harness.errors import HarnessError
from harness.ranks import backend
from harness.ranks.torchrun import _share_gpu


def test_each_rank_gets_its_own_nccl_host_on_loopback():
    envs = [backend.nccl_host_per_rank(r, {}) for r in range(4)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)
    # a user's interface is kept
    assert backend.nccl_host_per_rank(0, {"NCCL_SOCKET_IFNAME": "eth0"})["NCCL_SOCKET_IFNAME"] == (
        "eth0"
    )


def test_shared_ranks_take_their_index_modulo_the_gpus(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert backend.device_for("nccl", share_gpu=True) == torch.device("cuda", 0)
    assert seen == [0]


def test_more_ranks_than_gpus_without_share_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(HarnessError, match="add --share-gpu"):
        backend.device_for("nccl")


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (dict(share_gpu=True), "add --launcher torchrun"),
        (dict(share_gpu=True, launcher="torchrun", backend="gloo"), "for NCCL ranks"),
    ],
)
def test_share_gpu_outside_torchrun_nccl_is_refused(opts, message):
    with pytest.raises(HarnessError, match=message):
        CheckOptions(**opts).validate()


def test_share_gpu_needs_a_gpu_then_nccl(monkeypatch):
    """No CUDA comes first: without it the backend falls back to gloo, which is not the cause."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HarnessError, match=r"no CUDA device \(torch .*\)"):
        _share_gpu("gloo")
    with pytest.raises(HarnessError, match="no CUDA device"):
        backend.device_for("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(HarnessError, match="--device cuda"):
        _share_gpu("gloo")


def test_share_gpu_sets_the_rank_environment_before_nccl_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("RANK", "6")  # the global rank: IDs differ across nodes too
    # set first, so that monkeypatch restores both after the test
    monkeypatch.setenv("NCCL_HOSTID", "before")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    _share_gpu("nccl")
    assert os.environ["NCCL_HOSTID"] == "ring-harness-rank-6"
