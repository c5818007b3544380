"""`ring-harness selftest`: mutant names in the registry (never defaults), the kill matrix's pieces,
greedy shrinking, the fault stage that kills the buffer-discipline mutants, the equivalent-mutant
rule, and on real ranks: a kill shrunk, saved and replayed like a corpus case."""

from __future__ import annotations

import pytest
import torch

from harness.case import make_case
from harness.checks import kill_matrix, kill_witness, selftest
from harness.checks.options import FAULT_STAGE_DEFAULT, FAULT_STAGE_KINDS, CheckOptions, parse_kinds
from harness.checks.stages import faults as fault_stage
from harness.commands.cli import main
from harness.context import RunContext
from harness.errors import HarnessError
from harness.impls import registry
from harness.judging.verdicts import killed_by
from harness.result import CaseResult
from harness.search.shrink import candidates, shrink
from ring_impl.masks import MaskSpec
from ring_impl.mutants import MUTANTS


def stage(text):
    return parse_kinds(text, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT)


# -- registry
# ---------------------------------------------------------------------------------------


def test_every_mutant_resolves_without_an_import_permission():
    names = registry.mutant_names()
    assert names == [f"mutant:{n}" for n in MUTANTS] and len(names) >= 20
    for n in names:
        impl = registry.resolve(n, allow_import=False)
        assert impl.name == n and impl.capabilities.returns_lse


def test_mutants_are_never_defaults_or_listed_as_builtins():
    assert not any(n.startswith("mutant:") or n in MUTANTS for n in registry.builtin_names())
    assert not any(row["name"].startswith("mutant:") for row in registry.describe())
    assert selftest.mutant_names(None)[-1] == "reference"


def test_unknown_mutant_is_one_line():
    with pytest.raises(
        registry.ImplError, match="unknown mutant 'mutant:no-such-bug'; known: naive-merge-sum"
    ):
        registry.resolve("mutant:no-such-bug", allow_import=False)


def _single_rank_run(impl, q, k, v):
    ctx = RunContext(
        group=None,
        rank=0,
        world_size=1,
        global_ranks=(0,),
        layout="contiguous",
        lengths=(q.shape[1],),
        all_positions=(torch.arange(q.shape[1]),),
        mask=MaskSpec("causal"),
        softmax_scale=0.25,
        dtype=q.dtype,
        device=q.device,
    )
    return impl.run(q, k, v, ctx)


def test_a_mutant_impl_runs_its_mutant_the_way_the_reference_is_run():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=g) for _ in range(3))
    mut = _single_rank_run(registry.resolve("mutant:scale-one-over-d", allow_import=False), q, k, v)
    ref = _single_rank_run(registry.resolve("reference", allow_import=False), q, k, v)
    direct = MUTANTS["scale-one-over-d"](
        q, k, v, mask=MaskSpec("causal"), softmax_scale=0.25, return_lse=True
    )
    assert torch.equal(mut[0], direct[0]) and torch.equal(mut[1], direct[1])
    assert not torch.allclose(mut[0], ref[0])


def test_only_picks_mutants_and_the_reference():
    assert selftest.mutant_names("gqa-repeat, reference,gqa-repeat") == [
        "mutant:gqa-repeat",
        "reference",
    ]
    assert selftest.mutant_names("mutant:gqa-repeat") == ["mutant:gqa-repeat"]
    with pytest.raises(HarnessError, match="unknown mutant 'gqa-repat'"):
        selftest.mutant_names("gqa-repat")


def test_cli_bad_usage_exits_2(capsys):
    assert main(["selftest", "--only", "no-such-bug"]) == 2
    assert main(["selftest", "--false-alarm-cases", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_check_options_are_the_users_defaults():
    args = CheckOptions()
    assert (
        args.world_size,
        args.profile,
        args.max_examples,
        args.time_budget,
        args.fault_stage,
    ) == (4, "ci", None, None, ("early-read", "send-reuse"))
    assert selftest.false_alarm_options(args, 2000).max_examples == 2000
    assert selftest.false_alarm_options(args, None) is args


# -- equivalent mutants
# -----------------------------------------------------------------------------


def test_declared_equivalent_mutants_are_argued_in_writing():
    for name, why in kill_matrix.EQUIVALENT.items():
        assert name.startswith("mutant:") and kill_matrix.short(name) in MUTANTS, name
        assert len(why.split()) >= 25, (
            f"{name}: an equivalent mutant needs a written argument, got {why!r}"
        )


def test_a_survivor_fails_the_selftest_unless_argued_equivalent(monkeypatch):
    survivor = kill_matrix.MutantRun(name="mutant:gqa-repeat", status="survived")
    killed = kill_matrix.MutantRun(name="mutant:gqa-repeat", status="killed")
    assert not survivor.ok and killed.ok
    monkeypatch.setitem(kill_matrix.EQUIVALENT, "mutant:gqa-repeat", "argument " * 30)
    assert survivor.ok
    assert not killed.ok  # a kill contradicts the argument
    assert any("CONTRADICTION" in line for line in kill_matrix.notes(killed))


# -- kill matrix pieces
# -----------------------------------------------------------------------------


def test_comm_difference_counts_ops_per_phase():
    c = make_case(world_size=2, total_len=4)
    hop = ["isend", 1, 64, "forward", "done"]
    ref = CaseResult(case=c, impl="reference", verdict="pass", extra={"comm": {0: [hop], 1: [hop]}})
    same = CaseResult(
        case=c, impl="m", verdict="silent-corruption", extra={"comm": {0: [hop], 1: [hop]}}
    )
    fewer = CaseResult(
        case=c, impl="m", verdict="silent-corruption", extra={"comm": {0: [], 1: []}}
    )
    assert kill_witness.comm_difference(same, ref) == ""
    assert kill_witness.comm_difference(fewer, ref).startswith(
        "comm count: forward isend 0/0 vs 1/1"
    )
    assert (
        kill_witness.comm_difference(CaseResult(case=c, impl="m", verdict="fail-stop"), ref) == ""
    )


def test_kill_times_are_over_killed_mutants():
    run = kill_matrix.MutantRun
    runs = [
        run("mutant:a", "killed", seconds=1.0),
        run("mutant:b", "killed", seconds=5.0),
        run("mutant:c", "killed", seconds=2.0),
        run("mutant:d", "survived"),
    ]
    assert kill_matrix.kill_times(runs) == (2.0, 5.0, "mutant:b")


# -- shrinking
# ----------------------------------------------------------------------------------------


def _fake(pred):
    def still_fails(c):
        return CaseResult(case=c, impl="fake", verdict="silent-corruption") if pred(c) else None

    return still_fails


def test_shrink_reaches_the_smallest_failing_case():
    big = make_case(
        world_size=4,
        seq_lens=(9, 3, 7, 5),
        layout="striped",
        batch=2,
        heads_q=6,
        heads_kv=2,
        head_dim=24,
        mask={"kind": "window", "window": 5},
        dtype="bf16",
        values="large",
        softmax_scale=0.3,
        group_offset=2,
    )
    needs = lambda c: c.world_size >= 3 and c.mask.is_causal and c.heads_q > c.heads_kv >= 2  # noqa: E731
    r, tried = shrink(CaseResult(case=big, impl="fake", verdict="silent-corruption"), _fake(needs))
    c = r.case
    assert (c.world_size, c.seq_lens, c.batch, c.heads_q, c.heads_kv, c.head_dim) == (
        3,
        (1, 1, 1),
        1,
        4,
        2,
        1,
    )
    assert (c.mask, c.layout, c.dtype, c.values, c.softmax_scale, c.group_offset) == (
        MaskSpec("causal"),
        "contiguous",
        "fp32",
        "normal",
        None,
        0,
    )
    assert 0 < tried < 200


def test_shrink_keeps_faults_and_respects_its_budget():
    fault = {"kind": "early-read", "rank": 2}
    c = make_case(world_size=4, total_len=20, faults=(fault,))
    assert all(x.faults == c.faults and x.world_size >= 3 for x in candidates(c))
    r, tried = shrink(
        CaseResult(case=c, impl="fake", verdict="silent-corruption"),
        _fake(lambda c: True),
        max_tries=3,
    )
    assert tried == 3 and r.case.faults == c.faults


# -- fault stage ----------------------------------------------------------------------------------


def test_fault_stage_options():
    assert stage(None) == ("early-read", "send-reuse")
    assert stage("none") == ()
    assert stage("send-reuse,delay") == ("send-reuse", "delay")
    with pytest.raises(HarnessError, match="'drop' is not one of"):
        stage("drop")


def test_fault_stage_cases_cover_both_kinds_together_on_every_rank():
    from harness.context import Capabilities

    cases = fault_stage.plan(
        ("early-read", "send-reuse"), "reference", Capabilities(), max_world=4, deadline_s=8.0
    )
    assert [c.world_size for c in cases] == [2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert [len(c.faults) for c in cases[:3]] == [1, 1, 2]
    assert all(f.get("rank") is None and f.get("index") is None for c in cases for f in c.faults)
    assert [
        c.world_size
        for c in fault_stage.plan(("early-read",), "r", Capabilities(), max_world=3, deadline_s=8.0)
    ] == [2, 3]


# -- on real ranks
# ----------------------------------------------------------------------------------

POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py)


def test_the_default_fault_stage_kills_the_buffer_mutants_reproducibly(pool):
    from harness.context import Capabilities
    from harness.runner import run_case

    cases = fault_stage.plan(
        FAULT_STAGE_DEFAULT, "reference", Capabilities(), max_world=3, deadline_s=8.0
    )
    both, reuse = cases[2], cases[1]  # W2: early-read + send-reuse together; send-reuse alone
    for c in (both, reuse):
        assert run_case(c, pool, "reference").verdict == "pass"
    r = run_case(both, pool, "mutant:read-before-wait")
    assert r.verdict == "silent-corruption" and "out" in killed_by(r)
    assert kill_witness.reproduces(pool, "mutant:read-before-wait", r, 2)
    r = run_case(reuse, pool, "mutant:send-buffer-overwrite")
    assert r.verdict == "silent-corruption" and "send-buffer check" in killed_by(r)
    assert kill_witness.reproduces(pool, "mutant:send-buffer-overwrite", r, 2)


def test_selftest_kills_shrinks_and_saves_replayable_cases(pool, tmp_path):
    from harness import case as case_mod
    from harness.checks.replay import replay_expectations

    names = ["mutant:scale-one-over-d", "mutant:skipped-ring-step"]
    runs = selftest.run_selftest(pool, names, CheckOptions(), tmp_path, tmp_path / "corpus")
    for r in runs:
        # killed at the battery's first case, after the growth check's first run (which stops the
        # growth check)
        assert r.status == "killed" and r.ok and r.stage == "battery" and r.cases <= 3, (
            kill_matrix.row(r)
        )
        assert r.path == tmp_path / "corpus" / f"mutant-{kill_matrix.short(r.name)}.yaml"
        case, data = case_mod.load(r.path)
        assert case.impl == r.name and case.world_size <= 2 and case.total_len <= 2
        assert data["result"]["verdict"] == r.shrunk.verdict == "silent-corruption"
        assert replay_expectations(r.path, pool) == []
        assert "ring-harness check: " in r.log.read_text()  # the whole check log of the mutant
    skipped = runs[1]
    assert "forward isend" in skipped.comm and "comm count" in "\n".join(kill_matrix.notes(skipped))
    # the leading comment cites the bug
    assert "W - 1 ring steps" in r.path.read_text().split("format:")[0]


def test_impls_lists_mutants_only_when_asked(capsys):
    assert main(["impls"]) == 0
    assert "mutant:" not in capsys.readouterr().out
    assert main(["impls", "--mutants"]) == 0
    out = capsys.readouterr().out
    assert all(f"mutant:{n}" in out for n in MUTANTS) and "never a default" in out


def test_perturbed_timing_adds_one_jittered_delay_on_every_rank():
    c = make_case(world_size=3, total_len=6, faults=({"kind": "send-reuse"},))
    p = kill_witness.perturbed(c)
    assert p.faults[:1] == c.faults and p.faults[1]["kind"] == "delay"
    assert p.faults[1].get("rank") is None and p.faults[1]["jitter"] > 0
