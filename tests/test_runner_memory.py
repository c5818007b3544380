"""A case the machine cannot hold is refused up front with the memory estimate (issues #21, #51),
never a rank killed mid-run. Every dimension counts: batch, heads, head_dim and length. Small cases
never read the free memory."""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.errors import HarnessError
from harness.ranks import oom
from harness.runner import check_memory

LONG = dict(world_size=8, total_len=65536, layout="zigzag", mask={"kind": "causal"}, dtype="bf16")


def _free(monkeypatch, available: int) -> None:
    monkeypatch.setattr(oom, "meminfo", lambda: {"MemAvailable": available})
    monkeypatch.setattr(oom, "memory_limit", lambda: 1 << 62)


def test_a_case_larger_than_the_machine_is_refused_with_the_estimate(monkeypatch):
    big = make_case(**LONG, heads_q=4, heads_kv=4, head_dim=64)
    _free(monkeypatch, 8 << 30)
    with pytest.raises(
        HarnessError, match=r"too large for this machine: needs ~\d+\.\d GiB \(8 ranks x"
    ):
        check_memory(big)
    _free(monkeypatch, 1 << 50)
    check_memory(big)  # fits: no error


@pytest.mark.parametrize(
    "dims",
    [
        dict(batch=16, head_dim=4096, heads_q=4096, heads_kv=4096),
        dict(batch=4096, heads_q=512, heads_kv=64, head_dim=512),
        dict(batch=1024, heads_q=4096, heads_kv=8, head_dim=128),
    ],
)
def test_a_short_case_with_large_dimensions_is_refused_too(monkeypatch, dims):
    """One token per rank, but batch x heads x head_dim past any machine (#51: head_dim 10^8)."""
    _free(monkeypatch, 24 << 30)
    with pytest.raises(HarnessError, match="too large for this machine"):
        check_memory(make_case(world_size=2, total_len=2, **dims))


def test_small_cases_never_read_the_free_memory(monkeypatch):
    def boom():
        raise AssertionError("read the free memory for a small case")

    monkeypatch.setattr(oom, "meminfo", boom)
    check_memory(make_case(world_size=64, total_len=1024, heads_q=8, heads_kv=8, head_dim=128))
