"""A mistake in a user's adapter or its declaration is bad input: one line naming the field or the
call, exit 2 (issue #30). Exit 1 means only that the ring is wrong."""

from __future__ import annotations

import pytest

from harness.commands.cli import main
from harness.errors import HarnessError
from harness.impls import registry

MOD = "tests.helpers.adapter_mistakes"


def test_tuples_and_lists_are_declarations_like_sets():
    caps = registry.resolve(f"{MOD}:tuples").capabilities
    assert caps.layouts == frozenset({"contiguous", "zigzag"}) and caps.dtypes == frozenset(
        {"fp32", "bf16"}
    )
    assert caps.head_dims == (16, 32)


@pytest.mark.parametrize(
    "name, words",
    [
        ("misspelled_field", "unexpected keyword argument 'layout' (did you mean 'layouts'?)"),
        (
            "unknown_layout",
            "Capabilities.layouts: unknown layout 'zig-zag'; expected some of "
            "contiguous, zigzag, striped",
        ),
    ],
)
def test_a_declaration_mistake_is_one_line_and_exit_2(name, words, capsys):
    assert main(["check", "--impl", f"{MOD}:{name}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


POOL_SIZE = 2  # ranks of the module's `pool` (tests/conftest.py)


@pytest.mark.parametrize(
    "name, words",
    [
        (
            "typo",
            "run(q, k, v, ctx) raised on every rank before any communication: AttributeError: "
            "'RunContext' "
            "object has no attribute 'lenghts' (at adapter_mistakes.py:",
        ),
        (
            "short",
            "run(q, k, v, ctx) returned a wrong result on every rank: ShapeError: output shape "
            "(1, 3, 2, 16) != "
            "expected (1, 4, 2, 16)",
        ),
    ],
)
def test_an_adapter_that_raises_or_returns_the_wrong_shape_stops_the_check_before_any_stage(
    pool, name, words
):
    import io

    from harness.checks.check import run_check
    from harness.checks.options import CheckOptions
    from harness.checks.report import Reporter

    log = io.StringIO()
    with pytest.raises(HarnessError) as e:
        run_check(pool, CheckOptions(impl=f"{MOD}:{name}", world_size=2), reporter=Reporter(log))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "fix the adapter" in str(e.value) and "growth check" not in log.getvalue()


def test_a_ring_that_fails_mid_ring_is_still_a_finding_not_an_adapter_error(pool):
    from harness.case import make_case
    from harness.judging.verdicts import adapter_error
    from harness.runner import run_case

    # selftest's case
    r = run_case(make_case(world_size=2, seq_lens=(2, 1), impl="mutant:dkv-no-final-hop"), pool)
    assert r.verdict == "fail-stop" and adapter_error(r) is None
