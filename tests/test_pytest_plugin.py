"""The pytest plugin (harness.pytest_plugin).

Case files become test items with `--ring-cases`: one that cannot run fails with its reason, one
whose optional extra is missing is skipped, and `--ring-impl` replays them on another ring. The
`ring_check` fixture runs the adapted battery, the battery at `--ring-shape`, and a property run.
"""

from __future__ import annotations

import pytest

# pytester's in-process runs drop the torch modules they imported, but torch's operator
# registrations stay. Importing this first keeps a later assert_close from re-registering them.
import torch.distributed.tensor  # noqa: F401

from harness import case as case_mod
from harness.case import make_case
from harness.checks.options import CheckOptions
from harness.checks.stages import battery
from harness.impls import registry
from harness.impls.capabilities import unsupported
from harness.pytest_plugin import RingChecker
from harness.ranks.pool import RankPool
from harness.result import result_record
from harness.runner import run_case

BUGGY = "tests.helpers.impls:leaky"
NARROW = "tests.helpers.impls:narrow"
POOL_SIZE = 2  # ranks of the module's `pool` (tests/conftest.py)


# -- case files as test items ----------------------------------------------------------------------


def test_a_case_that_cannot_run_fails_with_its_reason(pytester):
    pytester.makefile(
        ".yaml", modpath=case_mod.dumps(make_case(world_size=1, total_len=2, impl="pkg.mod:ring"))
    )
    res = pytester.runpytest(
        "-p", "no:randomly", "--ring-cases", str(pytester.path), "-p", "no:cacheprovider"
    )
    res.assert_outcomes(failed=1)
    out = res.stdout.str()
    assert (
        "a case file never imports code; pass --ring-impl pkg.mod:ring" in out
        and "Traceback" not in out
    )


def test_a_case_whose_extra_is_missing_is_skipped_naming_it_unless_its_ring_is_given(pytester):
    """The project's corpus on the README's install: a case of a built-in whose library is an
    optional extra that is not installed is a skip naming the extra, and carries the `extra` marker
    (CI's extras step selects it with `-m extra`). Given explicitly with --ring-impl, the same case
    fails with the reason (#30)."""
    pytester.makefile(
        ".yaml", extra=case_mod.dumps(make_case(world_size=2, total_len=4, impl="te-cp-p2p"))
    )
    args = ["-p", "no:randomly", "--ring-cases", str(pytester.path), "-p", "no:cacheprovider"]
    skipped = pytester.runpytest(*args, "-rs")
    skipped.assert_outcomes(skipped=1)
    assert "pip install 'ring-harness[te]'" in skipped.stdout.str()
    pytester.runpytest(*args, "-m", "not extra").assert_outcomes(deselected=1)
    given = pytester.runpytest(*args, "--ring-impl", "te-cp-p2p")
    given.assert_outcomes(failed=1)
    assert "cannot run on te-cp-p2p" in given.stdout.str() and "Traceback" not in given.stdout.str()


def test_a_case_for_another_release_of_its_library_is_skipped_naming_both(pytester):
    """A real bug's case (ci/historical) replays only at the release it was found in. Under any
    other release the suite skips it, naming the release it needs and the one installed (#44)."""
    text = case_mod.dumps(make_case(world_size=2, total_len=4), expect="reproduce")
    pytester.makefile(".yaml", old=text + 'impl_version: "0.0.1"\n')
    res = pytester.runpytest("-p", "no:randomly", "--ring-cases", str(pytester.path), "-rs")
    res.assert_outcomes(skipped=1)
    out = res.stdout.str()
    installed = registry.resolve("reference").version
    assert f"needs reference at release 0.0.1 (installed: {installed})" in out, out


def test_cases_saved_against_a_buggy_ring_run_on_the_fixed_one_given_by_ring_impl(pytester, pool):
    """`pytest --ring-cases DIR --ring-impl mypkg:fixed` runs (and passes) what was saved against
    mypkg:buggy; on the buggy ring the same cases fail; a case the given ring does not declare
    fails, naming the feature."""
    for i, layout in enumerate(("contiguous", "zigzag")):
        c = make_case(
            world_size=2, total_len=8, layout=layout, mask={"kind": "causal"}, impl=BUGGY, seed=i
        )
        r = run_case(c, pool, BUGGY, allow_import=True)
        assert r.verdict == "silent-corruption"
        case_mod.save(c, pytester.path / f"saved{i}.yaml", result=result_record(r))
    args = [
        "-p",
        "no:randomly",
        "--ring-cases",
        str(pytester.path),
        "-p",
        "no:cacheprovider",
        "--ring-impl",
    ]
    pytester.runpytest(*args, "tests.helpers.impls:reference").assert_outcomes(passed=2)
    bad = pytester.runpytest(*args, BUGGY)
    bad.assert_outcomes(failed=2)
    assert "expected pass, got silent-corruption" in bad.stdout.str()
    striped = make_case(
        world_size=2, total_len=8, layout="striped", mask={"kind": "causal"}, impl=BUGGY
    )
    case_mod.save(striped, pytester.path / "striped.yaml")
    narrow = pytester.runpytest(*args, "torch-ring")  # declares contiguous and zigzag, not striped
    narrow.assert_outcomes(passed=2, failed=1)
    assert (
        "striped.yaml: cannot run on torch-ring: it does not declare layout striped"
        in narrow.stdout.str()
    )


# -- the ring_check fixture ------------------------------------------------------------------------


def test_the_plugin_runs_the_same_adapted_battery(monkeypatch):
    ran = []
    checker = RingChecker(pool=None, impl=NARROW, world_size=4, max_examples=0, faults="early-read")
    monkeypatch.setattr(checker, "run", lambda case, impl=None: ran.append(case) or _Passed(case))
    checker.battery()
    caps = registry.resolve(NARROW, allow_import=True).capabilities
    cases, _ = battery.plan(CheckOptions(impl=NARROW), caps)
    battery_part = ran[: len(cases)]
    assert [c.key() for c in battery_part] == [c.key() for c in cases]
    assert all(not unsupported(caps, c) for c in ran)
    assert any(c.faults for c in ran[len(cases) :])  # --ring-faults adds the fault stage


class _Passed:
    def __init__(self, case) -> None:
        self.case, self.passed, self.verdict, self.extra = case, True, "pass", {"as_expected": True}


def test_the_pytest_option_runs_the_battery_at_the_shape(tmp_path):
    # its own pool, of exactly 2 ranks: what the battery runs depends on the pool's size
    with RankPool(2) as pool:
        rc = RingChecker(
            pool, "reference", 4, None, None, save_dir=str(tmp_path), shape="hq2,hkv1,d32,L130,W2"
        )
        res = rc.battery(dtype="fp16")
        assert (
            res.passed and res.shape == "b1,hq2,hkv1,d32,L130,W2" and len(res.shape_results) == 12
        )
        with pytest.raises(pytest.fail.Exception, match="over --shape-budget"):
            rc.at_shape("b1,hq32,hkv8,d128,L8192,W8")


PINNED_TESTS = f"""
import pytest
from harness.case import make_case


@pytest.mark.ring_impl("tests.helpers.impls:reference")
def test_pinned(ring_check):
    ring_check(make_case(world_size=2, total_len=6, mask={{"kind": "causal"}}))


@pytest.mark.ring_impl("tests.helpers.impls:reference")
def test_pinned_too(ring_check):
    assert ring_check.impl == {BUGGY!r}


def test_unpinned(ring_check):
    assert ring_check.impl == {BUGGY!r}
"""


def test_ring_impl_on_the_command_line_wins_over_a_marker_and_says_so_once(pytester):
    """A pinned test runs the ring under test, not the marker's fixed ring: on a buggy --ring-impl
    it fails. One warnings-summary entry names both rings and lists each overridden test."""
    pytester.makepyfile(test_pinned=PINNED_TESTS)
    args = ["-p", "no:randomly", "-p", "no:cacheprovider", "--ring-impl", BUGGY]
    res = pytester.runpytest(*args, "-rf")
    res.assert_outcomes(failed=1, passed=2, warnings=2)
    out = res.stdout.str()
    assert "FAILED test_pinned.py::test_pinned" in out and "silent-corruption" in out
    said = (
        f"RingImplOverride: --ring-impl {BUGGY} overrides "
        "@pytest.mark.ring_impl('tests.helpers.impls:reference'): "
        f"the test runs {BUGGY}, not tests.helpers.impls:reference"
    )
    assert out.count(said) == 1, out
    listed = out[out.index("warnings summary") : out.index(said)].splitlines()[1:]
    assert [ln.strip() for ln in listed if "::" in ln] == [
        "test_pinned.py::test_pinned",
        "test_pinned.py::test_pinned_too",
    ]
    strict = pytester.runpytest(*args, "-W", "error::harness.pytest_plugin.RingImplOverride")
    strict.assert_outcomes(errors=2, passed=1)


def test_a_marker_is_the_default_without_ring_impl(pytester):
    pytester.makepyfile(
        test_marked="""
import pytest


@pytest.mark.ring_impl("tests.helpers.impls:reference")
def test_marked(ring_check):
    assert ring_check.impl == "tests.helpers.impls:reference"


@pytest.mark.ring_impl("reference")
def test_same_as_given(ring_check):
    assert ring_check.impl == "reference"


def test_plain(ring_check):
    assert ring_check.impl == "reference"
"""
    )
    args = ["-p", "no:randomly", "-p", "no:cacheprovider"]
    pytester.runpytest(*args).assert_outcomes(passed=3)
    # --ring-impl equal to a marker overrides nothing: no warning
    same = pytester.runpytest(
        *args, "--ring-impl", "reference", "test_marked.py::test_same_as_given"
    )
    same.assert_outcomes(passed=1)
    assert "RingImplOverride" not in same.stdout.str()


def test_plugin_property_run(ring_check):
    out = ring_check.property(max_examples=5, time_budget_s=60)
    assert out.examples >= 1 and out.passed
