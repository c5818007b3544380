"""Faults on real rank pools: the reference passes under benign faults and fail-stops under drop and
crash within the deadline, planted bugs are caught, unfired faults are invalid, the comm log counts
ring steps, hangs report pending ops, and the pool heals after every faulted case."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from harness import case as case_mod
from harness.case import make_case
from harness.faults.interpose import phase_counts
from harness.faults.oplog import comm_steps
from harness.faults.schema import make_fault
from harness.judging.verdicts import DEATH_OF
from harness.ranks.leftovers import leftover_workers
from harness.runner import run_case
from harness.search.fault_strategies import faulted_cases

DEADLINE = 6.0
POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


@pytest.fixture(scope="module")
def pool(pool):
    """The module's pool, recording every worker it ran: none may be left once it is closed."""
    pids: set[int] = set()
    pool.pids_seen = pids
    yield pool
    pids.update(pool.pids())
    pool.close()
    assert leftover_workers(pids) == []


def _run(pool, case, impl="reference"):
    r = run_case(case, pool, impl, allow_import=":" in impl)
    pool.pids_seen.update(pool.pids())
    return r


def _case(w=3, faults=(), **kw):
    kw.setdefault("total_len", 6 * w)
    kw.setdefault("layout", "zigzag")
    kw.setdefault("mask", {"kind": "causal"})
    return make_case(
        world_size=w, faults=tuple(faults), deadline_s=kw.pop("deadline_s", DEADLINE), **kw
    )


def _healed(pool, case):
    """After a faulted case, the same case without faults passes on the (healed) pool."""
    assert _run(pool, case.replace(faults=())).verdict == "pass"


@pytest.mark.parametrize(
    "fault",
    [
        make_fault("delay", seconds=0.01, jitter=0.01),
        make_fault("delay", rank=1, phase="backward", op="recv", seconds=0.05, where="complete"),
        make_fault("early-read"),
        make_fault("send-reuse"),
        make_fault("straggler", rank=2, factor=3),
        make_fault("straggler", rank=0, factor=2, slow="comm"),
    ],
    ids=lambda f: f["kind"],
)
def test_reference_is_bit_identical_under_benign_faults(pool, fault):
    r = _run(pool, _case(faults=[fault], seed=11))
    assert r.verdict == "pass", r.detail
    assert r.extra["fired"][0] >= 1 and r.extra["bit_identical"] is True and r.extra["as_expected"]


def test_drop_is_fail_stop_naming_op_peer_and_phase(pool):
    c = _case(
        w=2, layout="contiguous", faults=[make_fault("drop", rank=0, phase="forward", index=0)]
    )
    r = _run(pool, c)
    # within the deadline: not a wall-clock guess but the pool's own contract (it stops waiting at
    # the deadline and calls the case a hang), so a fail-stop verdict means every rank answered
    # before it
    assert r.verdict == "fail-stop" and r.extra["as_expected"], r.detail
    assert not r.hung and r.timings["wall_s"] < c.deadline_s
    assert r.extra["fired"] == {0: 1}
    assert r.errors and all(
        "peer rank" in e and ("forward" in e or "backward" in e) for e in r.errors.values()
    )
    assert r.extra["clear_errors"] == sorted(r.errors)
    _healed(pool, c)


@pytest.mark.parametrize(
    "how",
    [
        "sigkill",
        pytest.param("exit0", marks=pytest.mark.slow),
        pytest.param("exit1", marks=pytest.mark.slow),
    ],
)
def test_crash_is_fail_stop_and_the_pool_restarts(pool, how):
    c = _case(faults=[make_fault("crash", rank=1, phase="forward", index=1, how=how)])
    old = set(pool.pids())
    r = _run(pool, c)
    assert r.verdict == "fail-stop" and r.extra["as_expected"], r.detail
    # answered before the deadline (see above)
    assert not r.hung and r.timings["wall_s"] < c.deadline_s
    assert 1 in r.dead and r.dead[1].startswith(DEATH_OF[how])
    assert r.extra["fired"] == {0: 1}
    _healed(pool, c)
    assert not old & set(pool.pids())  # a fresh set of workers
    assert leftover_workers(old, wait_s=5.0, scan=False) == []


def test_corrupt_is_reported_as_what_happened(pool):
    c = _case(
        w=2,
        layout="contiguous",
        mask={"kind": "none"},
        faults=[make_fault("corrupt", rank=0, phase="forward", index=0, bit=30, count=16)],
    )
    r = _run(pool, c)
    assert r.verdict == "silent-corruption" and r.extra["fired"] == {0: 1}
    assert r.extra["as_expected"]  # any verdict but invalid
    assert run_case(c, pool).hashes == r.hashes  # seeded: the same flips every time


def test_a_fault_that_never_fires_makes_the_case_invalid(pool):
    r = _run(pool, _case(faults=[make_fault("drop", rank=0, phase="forward", index=50)]))
    assert r.verdict == "invalid" and "never fired" in r.detail and "otherwise pass" in r.detail
    assert not r.extra["as_expected"]


@pytest.mark.parametrize(
    "impl, fault",
    [
        ("tests.helpers.fault_impls:read_before_wait", make_fault("early-read")),
        ("tests.helpers.fault_impls:send_buffer_overwrite", make_fault("send-reuse")),
        ("tests.helpers.fault_impls:tour_read_early", make_fault("early-read")),
    ],
)
def test_planted_buffer_bugs_are_caught(pool, impl, fault):
    for w in (2, 3):
        c = _case(w=w, faults=[fault])
        r = _run(pool, c, impl)
        assert r.verdict == "silent-corruption" and r.extra["fired"][0] > 0, (w, r.detail)
        if "send" in impl:  # caught by the fault's own check, not by chance
            assert "send buffer modified before the send completed" in r.detail
        if "tour" in impl:  # passes without the fault: the fault is what catches it
            assert _run(pool, c.replace(faults=()), impl).verdict == "pass"


def test_every_wrapped_operation_logs_and_delivers_under_early_read(pool):
    c = _case(w=3, faults=[make_fault("early-read"), make_fault("send-reuse")])
    r = _run(pool, c, "tests.helpers.fault_impls:tour")
    assert r.verdict == "pass", r.detail
    fwd = phase_counts(r.extra["comm"][1])["forward"]
    for kind in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "all_to_all_single",
        "reduce_scatter_tensor",
        "scatter",
        "gather",
        "reduce",
        "barrier",
        "send",
        "recv",
    ):
        # nested calls (all_gather_into_tensor -> all_gather_single) log once
        assert fwd[kind] == 1, kind
    assert fwd["isend"] == fwd["irecv"] == 3  # batch_isend_irecv's pair + the ring's W-1 hops
    # a rooted collective's bytes are what the rank hands in: none on a scatter's other ranks
    sizes = {
        g: {k: b for k, _p, b, ph, _s in log if ph == "forward"}
        for g, log in r.extra["comm"].items()
    }
    assert sizes[0]["scatter"] == 3 * 2 * 4 and sizes[1]["scatter"] == 0


def test_comm_log_counts_the_ring_hops(pool):
    r = _run(pool, _case(w=3))
    assert comm_steps(r.extra["comm"]) == {0: 2, 1: 2, 2: 2}  # W-1 K/V sends per rank in forward
    assert comm_steps(r.extra["comm"], "forward", ("irecv",)) == {0: 2, 1: 2, 2: 2}
    for g, log in r.extra["comm"].items():
        sends = [
            peer
            for kind, peer, nbytes, phase, state in log
            if kind == "isend" and phase == "forward"
        ]
        assert sends == [(g + 1) % 3] * 2
        assert all(state == "done" for *_, state in log)


def test_hang_reports_pending_ops_and_tears_down(pool):
    c = _case(w=2, deadline_s=3.0)
    old = set(pool.pids())
    r = _run(pool, c, "tests.helpers.fault_impls:hang_pending")
    assert r.verdict == "hang"
    assert (
        "pending irecv from peer rank" in r.detail and "last blocked waiting on barrier" in r.detail
    )
    assert all(s.startswith("pending ops: ") for s in r.hung.values())
    assert leftover_workers(old, wait_s=5.0, scan=False) == []
    _healed(pool, c)


def test_faulted_case_file_replays_exactly(pool, tmp_path):
    c = _case(
        w=2,
        faults=[
            make_fault("delay", seconds=0.0, jitter=0.01),
            make_fault("corrupt", rank=1, phase="backward", op="recv", index=0, bit=29),
        ],
        seed=3,
    )
    first = _run(pool, c)
    loaded, _ = case_mod.load(
        case_mod.save(c, tmp_path / "c.yaml", result={"verdict": first.verdict})
    )
    again = _run(pool, loaded)
    assert (again.verdict, again.hashes, again.extra["fired"]) == (
        first.verdict,
        first.hashes,
        first.extra["fired"],
    )


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    case=faulted_cases(
        kinds=("delay", "early-read", "send-reuse", "straggler"),
        max_world=3,
        pool_size=3,
        max_tokens=12,
        max_heads=2,
        max_head_dim=8,
        subgroups=False,
        deadline_s=DEADLINE,
    )
)
def test_property_runs_mix_in_drawn_benign_faults(pool, case):
    """Benign faults drawn into property-based cases never change the outcome nor a single bit."""
    plain = _run(pool, case.replace(faults=()))
    r = _run(pool, case)
    assert (r.verdict, r.hashes) == (plain.verdict, plain.hashes), (case.faults, r.detail)
    if case.faults and plain.verdict == "pass":
        assert r.extra["as_expected"] and all(n > 0 for n in r.extra["fired"].values())
