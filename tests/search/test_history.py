"""Failures that depend on what ran before (issue #19, harness.search.history): the sequence case
format, delta debugging of the earlier runs, confirmation on fresh ranks, and a sequence that
replays bit for bit where the single case does not."""

from __future__ import annotations

import pytest

from harness import case as case_mod
from harness import case_sequence
from harness.case import make_case
from harness.case_sequence import CaseSequence, Step
from harness.errors import HarnessError
from harness.search import history, sequence_search
from harness.search.shrink import shrink

STALE = "tests.helpers.impls:stale_accumulator"  # a dk buffer cached across calls, never zeroed
LEAKY = "tests.helpers.impls:leaky"  # ignores the mask: fails on its first call


def _case(**kw):
    return make_case(
        **{"world_size": 2, "total_len": 6, "heads_q": 1, "heads_kv": 1, "head_dim": 4, **kw}
    )


# -- the sequence case format
# -------------------------------------------------------------------------


def test_a_sequence_file_round_trips_and_loads_as_its_last_case(tmp_path):
    seq = CaseSequence((Step(_case(seed=1)), Step(_case(seed=2), leak=False)))
    p = case_sequence.save_sequence(
        seq,
        tmp_path / "s.yaml",
        result={"verdict": "silent-corruption"},
        note="why",
        expect="reproduce",
    )
    assert p.read_text().startswith("# why\n")
    back, data = case_sequence.load_sequence(p)
    assert back == seq and case_mod.is_sequence(data)
    assert case_mod.recorded_result(data)["verdict"] == "silent-corruption"
    last, _ = case_mod.load(p)
    assert last == seq.last
    single = case_mod.save(_case(), tmp_path / "c.yaml")
    assert case_sequence.load_sequence(single)[0] == CaseSequence((Step(_case()),))


@pytest.mark.parametrize(
    "text, words",
    [
        ("sequence: []", "non-empty list"),
        ("sequence: [{world_size: 1, total_len: 2}]\nfoo: 1", "unknown sequence field(s): foo"),
        (
            "sequence: [{world_size: 1, total_len: 2, bogus: 1}]",
            "sequence[0]: unknown case field(s): bogus",
        ),
        (
            "sequence: [{world_size: 1, total_len: 2, result: {}}, {world_size: 1, total_len: 2}]",
            "sequence[0]: only the last case",
        ),
        ("sequence: [{world_size: 1, total_len: 2, leak_check: maybe}]", "leak_check"),
        (
            "sequence: [{world_size: 1, total_len: 2, head_dim: 0}]",
            "sequence[0]: case field 'head_dim'",
        ),
        ("sequence: [3]", "sequence[0]: a case must be a mapping"),
        ("sequence: [{world_size: 1, total_len: 2}]\nexpect: maybe", "expect"),
    ],
)
def test_a_malformed_sequence_file_is_one_error_line(text, words):
    with pytest.raises(HarnessError) as e:
        case_mod.loads(text, "f.yaml")
    assert (
        words in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("f.yaml: ")
    )


# -- minimisation, pure
# ------------------------------------------------------------------------------


def test_ddmin_finds_the_earlier_runs_that_matter():
    steps = [Step(_case(seed=s)) for s in range(10)]
    tried = []

    def reproduces(sub):
        tried.append(len(sub))
        seeds = {s.case.seed for s in sub}
        return "ok" if {3, 7} <= seeds else None

    best, r = sequence_search.ddmin(steps, "ok", reproduces)
    assert [s.case.seed for s in best] == [3, 7] and r == "ok"


def test_the_immediately_preceding_run_is_tried_first():
    steps = [Step(_case(seed=s)) for s in range(6)]
    last = Step(_case(seed=9))
    tried = []

    def reproduces(sub):
        tried.append([s.case.seed for s in sub])
        return "ok" if 5 in {s.case.seed for s in sub} else None

    best, _ = sequence_search.first_reproducing(steps, last, reproduces)
    assert tried == [[5]] and [s.case.seed for s in best] == [5]


def test_greedy_shrinking_steps_back_to_the_newest_candidate_that_fails_on_fresh_ranks():
    from harness.result import CaseResult, Verdict

    def res(c):
        return CaseResult(c, "x", Verdict.SILENT_CORRUPTION)

    big = make_case(world_size=4, total_len=16, head_dim=8)
    # every smaller candidate "fails" on the warm ranks; only cases with head_dim >= 4 fail on fresh
    # ranks
    best, _ = shrink(res(big), lambda c: res(c), budget_s=30, fresh=lambda r: r.case.head_dim >= 4)
    assert best.case.head_dim >= 4 and best.case != big
    plain, _ = shrink(res(big), lambda c: res(c), budget_s=30)
    assert plain.case.head_dim == 1  # without confirmation it would swap in a warm-only failure


# -- on real ranks
# -----------------------------------------------------------------------------------

POOL_SIZE = 2  # ranks of the module's `pool` (tests/conftest.py)


def test_a_history_dependent_failure_becomes_a_sequence_that_replays_bit_for_bit(pool, tmp_path):
    from harness.checks.replay import replay_on
    from harness.runner import run_case

    pool.start()
    c = _case(seed=4)
    first = run_case(c, pool, STALE, allow_import=True, leak=False)
    run_case(_case(seed=5, head_dim=8), pool, "reference", leak=False)  # unrelated: ddmin drops it
    again = run_case(c, pool, STALE, allow_import=True, leak=False)
    assert first.passed and not again.passed
    found = history.confirm(pool, again, STALE, leak=False, allow_import=True)
    assert found.history_dependent and found.fresh.passed and found.earlier == 2
    assert [s.case for s in found.sequence.steps] == [c.replace(impl=STALE)] * 2
    assert (
        "history-dependent: on fresh ranks this case alone gives pass; after 2 earlier cases"
        in found.evidence()
    )
    path = history.save_sequence(found, tmp_path / "seq.yaml", expect="reproduce")
    rp = replay_on(pool, path, STALE, allow_import=True)  # the pool is restarted: fresh ranks
    assert (
        rp.sequence == 2 and rp.verdict_reproduced and rp.hashes_compared and not rp.hash_mismatches
    )
    seq, _ = case_sequence.load_sequence(path)
    # the same sequence on the reference
    assert history.run_file_sequence(pool, seq, "reference").passed


def test_a_failure_that_does_not_depend_on_history_is_confirmed(pool):
    from harness.runner import run_case

    r = run_case(_case(seed=6, mask={"kind": "causal"}), pool, LEAKY, allow_import=True)
    found = history.confirm(pool, r, LEAKY, allow_import=True)
    assert (
        not r.passed and found.confirmed and not found.history_dependent and found.sequence is None
    )
    assert found.reproducer is found.fresh and history.same_run(found.fresh, r)


def test_sequence_shrinking_keeps_the_history_and_the_failure(pool):
    from harness.runner import run_case

    pool.start()
    c = make_case(world_size=2, total_len=9, heads_q=2, heads_kv=2, head_dim=8, seed=7)
    run_case(c, pool, STALE, allow_import=True, leak=False)
    again = run_case(c, pool, STALE, allow_import=True, leak=False)
    found = history.confirm(pool, again, STALE, leak=False, allow_import=True)
    history.shrink_sequence(found, budget_s=60, max_tries=12, allow_import=True)
    seq = found.sequence
    assert (
        len(seq.steps) == 2
        and seq.steps[0].case == seq.last
        and history.outcome(found.seq_result) != "pass"
    )
    assert history.outcome(found.seq_result).startswith("silent-corruption (backward: dk")
    assert (seq.last.world_size, seq.last.total_len, seq.last.head_dim) < (2, 9, 8)
