"""What a failing check tells the user: one saved file per failure group (the rest counted),
--maxfail / -x as in pytest, and a last line that states what the exit status means."""

from __future__ import annotations

import json

from harness import CheckOptions, check
from harness.checks.report import ListReporter
from harness.commands.cli import main

LEAKY = "tests.helpers.impls:leaky"  # ignores the mask: every masked case fails the same few ways
WHOLE_WORLD = "tests.helpers.impls:whole_world_leaky"  # the same, and its ring is the whole world


def battery_only(impl: str, save_dir, **more) -> CheckOptions:
    """The battery alone at W = 2: no property run, fault stage, scale stage, growth or repeat."""
    base = dict(
        world_size=2, max_examples=0, fault_stage=(), scale=False, growth=False, repeat=False
    )
    return CheckOptions(impl=impl, save_dir=str(save_dir), **{**base, **more})


def test_one_saved_file_per_failure_group(tmp_path):
    rep = ListReporter()
    res = check(
        battery_only(LEAKY, tmp_path),
        reporter=rep,
    )
    failing = [r for r in res.results if not r.passed]
    files = sorted(tmp_path.glob("*.yaml"))
    assert not res.passed and len(failing) > len(files) >= 1
    # the helper declares the original masks only: the mask-language cases are probes, whose
    # findings are grouped the same way (undeclared features + failure signature), one file each
    assert (
        len(files)
        == len(res.distinct) + len(res.finding_files)
        == len({tuple(k) for k in res.distinct}) + len({tuple(k) for k in res.finding_files})
    )
    assert sum(n for _, n in res.finding_files.values()) == len(res.findings)
    assert sum(n for _, n in res.distinct.values()) == len(failing)
    assert sum("same failure as" in line for line in rep.lines) == len(failing) - len(res.distinct)
    assert (
        rep.lines[-1].startswith("check FAILED (exit 1): battery ")
        and f"{len(res.groups)} failure group(s)" in rep.lines[-1]
    )
    # one group per bug, each listing its saved file, its experiments' line first: the ring
    # ignores the mask, and its smallest case passes with no mask and with nothing else changed
    assert len(res.groups) == len(res.distinct) >= 1
    assert {p for g in res.groups for p in g.saved} == {str(p) for p, _ in res.distinct.values()}
    block = rep.lines.index(next(x for x in rep.lines if " failure group" in x and "(one per" in x))
    assert rep.lines[block + 1].lstrip().startswith("1. passes at no mask; still fails at W = 2")


def test_maxfail_stops_the_check(tmp_path):
    rep = ListReporter()
    res = check(
        battery_only(LEAKY, tmp_path, maxfail=2),
        reporter=rep,
    )
    assert len(res.failures) == 2 and sum(not r.passed for r in res.results) == 2
    assert "stopped at battery case" in rep.lines[-1]


def test_a_ring_that_hangs_stops_the_check_after_max_hangs(tmp_path):
    """Each hanging case waits out its deadline and restarts the ranks; the check stops at
    --max-hangs and its last line says why (issue #17: a ring hanging on one rank must not cost the
    check 20 minutes). The preflight case (W=2) and the growth check, which run first, hang at their
    W=2 runs: with the same --deadline, and counted."""
    from harness.checks.stages import battery
    from harness.impls import registry

    rep = ListReporter()
    opts = CheckOptions(
        impl="tests.helpers.impls:hang_on_rank1",
        world_size=2,
        deadline=2.0,
        max_examples=0,
        fault_stage=(),
        repeat=False,
        save_dir=str(tmp_path),
        max_hangs=2,
    )
    res = check(opts, reporter=rep)
    grown = [r for gc in res.growth.cases for r in gc.results.values()]
    assert [r.verdict for r in grown] == ["pass", "hang"] and grown[1].case.deadline_s == 2.0
    hung = [r for r in res.results if r.verdict == "hang"]
    planned, _ = battery.plan(opts, registry.resolve(opts.impl, allow_import=True).capabilities)
    # preflight, growth, the battery's first
    assert res.hangs == 3 and len(hung) == 1 and not res.passed
    # stopped: the rest and the property stage skipped
    assert len(res.results) < len(planned) and res.prop is None
    assert all(r.passed for r in res.results if r.verdict != "hang")  # only the W=1 cases passed
    assert "3 hanging case(s)" in rep.lines[-1] and "--max-hangs 2" in rep.lines[-1], rep.lines[-1]
    assert len(list(tmp_path.glob("*.yaml"))) == 1  # one hang, one file


def test_a_passing_check_says_so_last(tmp_path, capsys):
    assert (
        main(
            [
                "check",
                "--world-size",
                "2",
                "--max-examples",
                "0",
                "--fault-stage",
                "none",
                "--no-scale",
                "--no-growth",
                "--no-repeat",
                "--save-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("check PASSED (exit 0):") and not list(tmp_path.iterdir())


def test_x_is_maxfail_one(tmp_path, capsys):
    assert (
        main(
            [
                "check",
                "--impl",
                LEAKY,
                "--world-size",
                "2",
                "--max-examples",
                "0",
                "--fault-stage",
                "none",
                "--no-scale",
                "--no-growth",
                "--no-repeat",
                "-x",
                "--save-dir",
                str(tmp_path),
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert (
        "stopped at battery case" in out.strip().splitlines()[-1]
        and len(list(tmp_path.iterdir())) == 1
    )


def test_rows_show_lse_and_details_name_non_finite_values():
    from harness.case import make_case
    from harness.checks import report
    from harness.result import CaseResult, TensorCheck, Verdict

    assert report.header().split()[2:7] == ["out", "lse", "dq", "dk", "dv"]
    nan = TensorCheck(
        "out", 1, float("inf"), 1e-6, 3, {"batch": 0, "token": 5, "head": 0}, False, "NaN"
    )
    lse = TensorCheck("lse", 0, 2e-7, 1e-6, 0, {"batch": 0, "token": 1, "head": 0}, True)
    r = CaseResult(
        make_case(world_size=2, total_len=8), "x", Verdict.SILENT_CORRUPTION, checks=[nan, lse]
    )
    row = report.row(1, 1, r)
    assert "nonfin" in row and " 0.200 " in row
    text = "\n".join(report.details(r))
    assert "out rank 1: 3 non-finite value(s) (NaN)" in text and "inf" not in text.split("(NaN)")[1]


def test_the_repeat_check_catches_state_carried_over_between_calls(tmp_path):
    """A gradient buffer cached across calls and never zeroed: exact on the first call, wrong on
    every later one. The battery runs each case twice on the same ranks; the second run's bits
    differ."""
    from harness.judging.verdicts import killed_by

    rep = ListReporter()
    res = check(
        CheckOptions(
            impl="tests.helpers.impls:stale_accumulator",
            world_size=2,
            max_examples=0,
            scale=False,
            growth=False,
            fault_stage=(),
            save_dir=str(tmp_path),
            maxfail=1,
        ),
        reporter=rep,
    )
    r = res.results[0]
    assert r.verdict == "diverged" and r.extra["repeat"]["identical"] is False, r.detail
    assert "repeat" in killed_by(r) and r.detail.startswith("repeat: the same case run again")
    ok = check(
        CheckOptions(
            world_size=2,
            max_examples=0,
            fault_stage=(),
            scale=False,
            growth=False,
            save_dir=str(tmp_path),
        ),
        reporter=ListReporter(),
    )
    assert ok.passed and all(r.extra["repeat"]["identical"] for r in ok.results)


def test_every_file_saved_for_a_history_bug_replays_its_recorded_verdict_on_fresh_ranks(tmp_path):
    """Issue #19: the battery's repeat failure is history-dependent (the case alone passes on fresh
    ranks), so it is saved as a sequence case; every saved file, single or sequence, replays to its
    recorded verdict with identical hashes on fresh ranks."""
    from harness.checks.replay import replay_on
    from harness.ranks.pool import RankPool

    stale = "tests.helpers.impls:stale_accumulator"
    rep = ListReporter()
    res = check(
        CheckOptions(
            impl=stale,
            world_size=2,
            max_examples=0,
            fault_stage=("early-read",),
            growth=False,
            scale=False,
            save_dir=str(tmp_path),
        ),
        reporter=rep,
    )
    text = "\n".join(rep.lines)
    assert (
        not res.passed
        and "history-dependent: on fresh ranks this case alone gives pass; after" in text
    )
    files = sorted(tmp_path.glob("*.yaml"))
    assert any(f.name.endswith("-sequence.yaml") for f in files)
    # (+ undeclared-feature probe findings)
    assert len(files) == len(res.distinct) + len(res.finding_files)
    for f in files:
        with RankPool(2) as pool:
            rp = replay_on(pool, f, stale, allow_import=True)
        assert rp.verdict_reproduced and not rp.hash_mismatches and rp.hashes_compared, (
            f.name,
            rp.result.detail,
        )


def test_a_whole_world_ring_is_checked_at_every_ring_size_and_the_json_names_the_first_failure(
    tmp_path,
):
    """A ring that must be the whole world restarts the pool at each case's size. The check plans
    with the pool's capacity, not its size of the moment. Before, after a W=2 case, it skipped
    every larger case, and the property run drew W=1 and crashed (#44, ring-attention-pytorch).
    The JSON's `first_failure` gives the stage and seconds that ci/historical tabulates."""
    js = tmp_path / "out.json"
    rep = ListReporter()
    res = check(
        # one property example: it runs on the restarted pool, and passes (no shrinking to pay for)
        battery_only(WHOLE_WORLD, tmp_path / "saved", world_size=4, max_examples=1, json=str(js)),
        reporter=rep,
    )
    assert not res.passed and not any("skipping" in line for line in rep.lines), rep.lines[:3]
    assert {r.case.world_size for r in res.results} > {2}
    assert res.prop is not None and res.prop.examples >= 1
    first = json.loads(js.read_text())["first_failure"]
    assert first["stage"] == "battery" and first["seconds"] > 0 and first["cases"] >= 1
