"""Collective faults on a real rank pool (issue #52): the fault stage fires on rings that move data
only by collectives (the README's all-gather ring, torch's rings), with no false alarm; a dropped
collective is a fail-stop naming the op, its group and the phase; the two collective mutants are
killed by the default fault stage; a process group made inside run is one line, never a hang."""

from __future__ import annotations

import io

import pytest

from harness.case import make_case
from harness.checks import kill_witness
from harness.checks.check import Check, run_check
from harness.checks.options import CheckOptions
from harness.checks.report import ListReporter, Reporter
from harness.checks.stages import faults as fault_stage
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.faults.pg_guard import REFUSED
from harness.faults.schema import make_fault
from harness.judging.verdicts import killed_by
from harness.result import Verdict
from harness.runner import run_case

POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py): a ring of 2 leaves one idle
HELPERS = "tests.helpers.collective_impls"
README_RING = f"{HELPERS}:readme_ring"


def _stage(pool, impl: str) -> tuple[list, list[str]]:
    """The fault stage alone, as the default check runs it, on this pool."""
    log = ListReporter()
    check = Check(pool, CheckOptions(impl=impl), reporter=log)
    assert fault_stage.run(check) is False, "\n".join(log.lines)
    return check.outcome.fault_results, log.lines


def test_the_fault_stage_fires_on_a_ring_of_blocking_collectives(pool):
    results, lines = _stage(pool, README_RING)
    # a blocking all-gather gives early-read and send-reuse nothing to act on: not applicable
    planned = [r for r in results if r.case.faults[0]["kind"] != "delay"]
    assert planned and all(r.verdict == Verdict.INVALID for r in planned)
    late = [r for r in results if r.case.faults[0]["kind"] == "delay"]
    assert [r.case.world_size for r in late] == [2, 3]
    assert all(r.verdict == Verdict.PASS and r.extra["fired"][0] >= 2 for r in late), [
        r.detail for r in late
    ]
    assert all(r.extra["bit_identical"] for r in late)
    assert any("the ring uses collectives: 2 more cases" in line for line in lines)


@pytest.mark.parametrize("impl", ["torch-ring", "torch-ring-alltoall"])
def test_torch_rings_pass_the_fault_stage_with_every_collective_fault_firing(pool, impl):
    results, _ = _stage(pool, impl)
    assert len(results) == 8  # W = 2 and 3: early-read, send-reuse, both; then one rank late
    for r in results:
        assert r.verdict == Verdict.PASS and r.extra["as_expected"], (r.case.faults, r.detail)
        assert all(n > 0 for n in r.extra["fired"].values()), r.extra["fired"]


def test_the_battery_gives_a_ring_without_p2p_faults_on_collectives(pool):
    from harness.checks.fault_battery import _collectives_only

    c = make_case(world_size=2, total_len=8)
    assert _collectives_only(pool, c, "torch-ring", False)
    assert not _collectives_only(pool, c, "reference", False)


@pytest.mark.parametrize(
    "impl, op",
    [("tests.helpers.fault_impls:allgather", "collective"), ("torch-ring", "all_gather")],
)
def test_a_dropped_collective_is_a_fail_stop_naming_op_group_and_phase(pool, impl, op):
    drop = make_fault("drop", rank=1, phase="forward", op=op, index=0)
    c = make_case(
        world_size=2, total_len=8, layout="contiguous", mask={"kind": "none"}, deadline_s=6.0
    )
    # warm first: a ring's first case on a pool imports its library within the case's deadline
    assert run_case(c, pool, impl, allow_import=":" in impl).verdict == Verdict.PASS
    r = run_case(c.replace(faults=(drop,)), pool, impl, allow_import=":" in impl)
    assert r.verdict == Verdict.FAIL_STOP and r.extra["as_expected"], r.detail
    assert not r.hung and r.timings["wall_s"] < c.deadline_s
    assert r.extra["clear_errors"] == [0, 1]
    for e in r.errors.values():
        assert "all_gather" in e and "with peer ranks 0, 1 (forward, op #0)" in e, e
    assert "dropped it on this rank" in r.errors[1]
    assert run_case(c, pool, impl, allow_import=":" in impl).verdict == Verdict.PASS  # healed


def test_a_corrupted_collective_output_is_silent_corruption(pool):
    c = make_case(world_size=2, total_len=8, layout="contiguous", mask={"kind": "none"})
    bad = make_fault("corrupt", rank=0, phase="forward", op="all_gather", bit=30, count=8)
    r = run_case(c.replace(faults=(bad,)), pool, README_RING, allow_import=True)
    assert r.verdict == Verdict.SILENT_CORRUPTION and r.extra["fired"] == {0: 1}, r.detail


@pytest.mark.parametrize(
    "name, which, check",
    [
        ("all-gather-read-before-wait", "early-read", "out"),
        ("all-to-all-input-reuse", "send-reuse", "send-buffer check"),
    ],
)
def test_the_collective_mutants_are_killed_by_the_default_fault_stage(pool, name, which, check):
    cases = fault_stage.plan(
        ("early-read", "send-reuse"), "reference", Capabilities(), max_world=2, deadline_s=8.0
    )
    c = next(c for c in cases if [f["kind"] for f in c.faults] == [which])
    impl = f"mutant:{name}"
    assert run_case(c.replace(faults=()), pool, impl).verdict == Verdict.PASS  # right unfaulted
    r = run_case(c, pool, impl)
    assert r.verdict == Verdict.SILENT_CORRUPTION and check in killed_by(r), r.detail
    assert kill_witness.reproduces(pool, impl, r, 1)


@pytest.mark.parametrize(
    "name, call",
    [
        ("group_in_run", "torch.distributed.new_group(ranks=[0, 1])"),
        ("mesh_in_run", "DeviceMesh(...)"),
    ],
)
def test_a_process_group_made_inside_run_stops_the_check_in_one_line(pool, name, call):
    log = io.StringIO()
    opts = CheckOptions(impl=f"{HELPERS}:{name}", world_size=2)
    with pytest.raises(HarnessError) as e:
        run_check(pool, opts, reporter=Reporter(log))
    msg = str(e.value)
    assert f"{call} {REFUSED}" in msg and "ctx.group" in msg and "\n" not in msg, msg
    assert "fix the adapter" in msg and "collective_impls.py" in msg  # the user's own line
    assert "growth check" not in log.getvalue()


def test_a_local_group_of_the_rings_own_ranks_is_allowed_and_never_hangs(pool):
    impl = f"{HELPERS}:local_group_in_run"
    for w in (2, 3, 2):  # rank 2 knows fewer groups than ranks 0, 1 by the W = 3 case
        c = make_case(world_size=w, total_len=4 * w, deadline_s=10.0)
        r = run_case(c, pool, impl, allow_import=True)
        assert r.verdict == Verdict.PASS, r.detail


def test_a_mesh_made_inside_run_is_exit_2_in_one_line(capsys):
    from harness.commands.cli import main

    argv = ["check", "--impl", f"{HELPERS}:mesh_in_run", "--world-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"DeviceMesh(...) {REFUSED}" in err[0], err


@pytest.mark.extra
def test_the_fault_stage_fires_on_deepspeeds_ulysses(pool):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    results, _ = _stage(pool, "deepspeed-ulysses")
    fired = [r for r in results if r.verdict != Verdict.INVALID]
    assert fired and all(r.verdict == Verdict.PASS and r.extra["as_expected"] for r in fired)
    assert any(r.case.faults[0]["kind"] == "delay" for r in fired)
