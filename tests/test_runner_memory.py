"""A case the machine cannot hold is refused up front with the memory estimate (issue #21), never a
rank killed mid-run; small cases never pay for the estimate."""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.errors import HarnessError
from harness.ranks import oom
from harness.runner import LARGE_CASE_TOKENS, check_memory


def test_a_case_larger_than_the_machine_is_refused_with_the_estimate(monkeypatch):
    big = make_case(
        world_size=8,
        total_len=65536,
        layout="zigzag",
        mask={"kind": "causal"},
        dtype="bf16",
        heads_q=4,
        heads_kv=4,
        head_dim=64,
    )
    real = oom.estimate
    monkeypatch.setattr(oom, "estimate", lambda case, **kw: real(case, available=8 << 30, **kw))
    with pytest.raises(
        HarnessError,
        match=r"too large for this machine: needs ~\d+\.\d GiB \(8 "
        r"ranks x",
    ):
        check_memory(big)
    monkeypatch.setattr(oom, "estimate", lambda case, **kw: real(case, available=1 << 50, **kw))
    check_memory(big)  # fits: no error


def test_small_cases_are_not_estimated(monkeypatch):
    def boom(case, **kw):
        raise AssertionError("estimated a small case")

    monkeypatch.setattr(oom, "estimate", boom)
    check_memory(make_case(world_size=4, total_len=LARGE_CASE_TOKENS - 1))
