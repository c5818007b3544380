"""The pytest plugin (entry point `pytest11`): check a ring attention inside any project's tests.

Options: --ring-impl, --ring-world-size, --ring-max-examples, --ring-faults, --ring-shape,
--ring-cases DIR and --ring-device (cpu or cuda, docs/gpu.md). Fixtures: `ring_pool`, one rank pool
per pytest process, and `ring_check`, which runs cases and asserts. Marker:
`@pytest.mark.ring_impl("name")` names the implementation for one test. Case files (*.yaml) under
the `--ring-cases` folders or the `ring_cases` ini option become test items that replay the recorded
case.

Which implementation `ring_check` runs: `--ring-impl` when it is given, else the test's marker, else
`reference`. The command line wins, so a run of a ring under test runs it in every test, the pinned
ones too. A test whose marker names another ring then runs `--ring-impl`, and pytest says so: a
`RingImplOverride` warning naming both. The warnings summary shows it once, listing every such
test. `-W error::harness.pytest_plugin.RingImplOverride` makes those tests errors instead.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest


class RingImplOverride(UserWarning):
    """--ring-impl names another ring than a test's ring_impl marker: the test runs --ring-impl."""


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("ring-harness", "ring attention validation (ring-harness)")
    g.addoption(
        "--ring-impl",
        default=None,
        help="implementation to validate (built-in name or pkg.mod:attr)",
    )
    g.addoption(
        "--ring-world-size", type=int, default=4, help="ring size for ring_check (default 4)"
    )
    g.addoption(
        "--ring-max-examples", type=int, default=None, help="property-based examples per ring_check"
    )
    g.addoption(
        "--ring-faults",
        default=None,
        help="benign fault kinds ring_check.battery() also runs as its fault stage, on "
        "every rank and op: "
        "comma list of early-read, send-reuse, delay, straggler",
    )
    g.addoption(
        "--ring-shape",
        default=None,
        metavar="SPEC",
        help="your training shape, e.g. b1,hq32,hkv8,d128,L8192,W8: ring_check.battery() "
        "runs the layout x "
        "mask x dtype basics and the growth check at exactly that shape (refused up "
        "front when it cannot "
        "fit)",
    )
    g.addoption(
        "--ring-cases",
        action="append",
        default=[],
        metavar="DIR",
        help="directory of case YAML files to replay as tests (repeatable)",
    )
    g.addoption(
        "--ring-device",
        default=None,
        choices=("cpu", "cuda"),
        help="where the pool's ranks compute: cpu, or cuda (W gloo ranks on the visible "
        "GPUs, P2P staged "
        "through pinned host memory; docs/gpu.md)",
    )
    g.addoption(
        "--ring-stage-p2p",
        action="store_true",
        default=False,
        help="stage P2P through host buffers on CPU ranks too, as --ring-device cuda does",
    )
    parser.addini(
        "ring_cases", "directories of case YAML files to replay as tests", type="paths", default=[]
    )


def pytest_configure(config: pytest.Config) -> None:
    from harness import limits
    from harness.errors import HarnessError

    try:
        limits.options(
            {
                "--world-size": config.getoption("--ring-world-size"),
                "--max-examples": config.getoption("--ring-max-examples"),
            }
        )
    except HarnessError as e:
        raise pytest.UsageError(f"ring-harness: {str(e).replace('--', '--ring-', 1)}") from None
    config.addinivalue_line(
        "markers",
        "ring_impl(name): run ring_check against this implementation (--ring-impl, when given, wins)",
    )
    config.addinivalue_line(
        "markers", "extra: needs an optional third-party implementation (a case file's ring)"
    )


@pytest.fixture(scope="session")
def ring_pool(request: pytest.FixtureRequest):
    """A persistent rank pool for this pytest process; grows on demand, torn down at session end."""
    return _session_pool(request.session)


class RingChecker:
    """Callable fixture object: `ring_check(case)`, `.battery()`, `.property()`; fails the test on a
    failure and saves each failing case (YAML under `save_dir`, as `ring-harness check` does). Cases
    follow the implementation's declared capabilities, like the default check: the battery is
    adapted to the nearest declared features, the property-based run draws only from them."""

    def __init__(
        self,
        pool,
        impl: str,
        world_size: int,
        max_examples: int | None,
        faults: str | None,
        save_dir: str = "ring-harness-failures",
        shape: str | None = None,
    ) -> None:
        self.pool = pool
        self.impl = impl
        self.world_size = world_size
        self.max_examples = max_examples
        self.faults = faults  # benign fault kinds for battery()'s fault stage (--ring-faults)
        self.save_dir = save_dir
        self.shape = shape  # --ring-shape: battery() runs at this shape

    def _allow_import(self, name: str) -> bool:
        from harness.impls import registry

        return registry.is_module_path(name)

    def _caps(self):
        from harness.impls import registry

        return registry.resolve(self.impl, allow_import=self._allow_import(self.impl)).capabilities

    def run(self, case, impl: str | None = None):
        """Run one case and return its CaseResult (no assertion)."""
        from harness.errors import HarnessError
        from harness.runner import run_case

        name = impl or self.impl
        try:
            return run_case(case, self.pool, name, allow_import=self._allow_import(name))
        except HarnessError as e:  # bad input, e.g. a case too large for this machine: one line
            pytest.fail(f"ring-harness: {e}", pytrace=False)

    def _fail(self, bad: list) -> None:
        from harness.checks.report import details
        from harness.result import save_result

        lines = []
        for r in bad:
            path = save_result(r, self.save_dir, backend=getattr(self.pool, "backend", "gloo"))
            lines += [f"{r.verdict}: {r.case.summary()} (saved {path})", *details(r)]
        pytest.fail("\n".join(lines), pytrace=False)

    def __call__(self, case, impl: str | None = None):
        """Run one case and fail the test unless its verdict is `pass` (the failing case is saved).
        A case with a feature the implementation does not declare is skipped, naming the feature."""
        from harness.impls import registry
        from harness.impls.capabilities import feature_words, unsupported

        name = impl or self.impl
        caps = registry.resolve(name, allow_import=self._allow_import(name)).capabilities
        missing = unsupported(caps, case)
        if missing:
            words = "; ".join(
                feature_words(
                    f, caps, heads_q=case.heads_q, heads_kv=case.heads_kv, lengths=case.seq_lens
                )
                for f in missing
            )
            pytest.skip(f"{name} does not declare {words}: {case.summary()}")
        r = self.run(case, impl)
        if not r.passed:
            self._fail([r])
        return r

    def property(
        self, max_examples: int | None = None, time_budget_s: float | None = None, save_dir=None
    ):
        """A property-based run (hypothesis, shrinking, saved YAML) over the declared capabilities;
        fails with the shrunk case. Budget: `max_examples`, else --ring-max-examples, else the ci
        profile."""
        from harness import outputs
        from harness.errors import HarnessError
        from harness.search.fuzz import fuzz

        try:
            outputs.check_dir(save_dir or self.save_dir, "save_dir")
        except HarnessError as e:
            pytest.fail(f"ring-harness: {e}", pytrace=False)
        n = max_examples if max_examples is not None else self.max_examples
        out = fuzz(
            self.impl,
            self.pool,
            max_examples=n,
            time_budget_s=time_budget_s,
            caps=self._caps(),
            save_dir=save_dir or self.save_dir,
            allow_import=self._allow_import(self.impl),
        )
        if not out.passed:
            r = out.shrunk or out.found
            pytest.fail(
                f"property-based run found {r.verdict}: {r.case.summary()} "
                f"(saved {out.shrunk_path or out.found_path})",
                pytrace=False,
            )
        return out

    def at_shape(
        self, shape: str | None = None, dtype: str | None = None, budget_s: float = 3600.0
    ):
        """The layout x mask x dtype basics and the growth check at exactly `shape` (default
        --ring-shape), after the estimate (a shape that cannot fit, or exceeds `budget_s`, fails the
        test with the estimate); fail listing every failing case."""
        import io

        from harness.checks.check import run_check
        from harness.checks.options import CheckOptions
        from harness.checks.report import Reporter
        from harness.errors import HarnessError

        opts = CheckOptions(
            impl=self.impl,
            shape=shape or self.shape,
            dtype=dtype,
            shape_budget=budget_s,
            save_dir=self.save_dir,
        ).validate()
        log = io.StringIO()
        try:
            res = run_check(self.pool, opts, reporter=Reporter(log))
        except HarnessError as e:
            pytest.fail(str(e), pytrace=False)
        if not res.passed:
            bad = [f.result for f in res.failures if f.stage != "growth"]
            growth = [f.growth.detail for f in res.failures if f.growth is not None]
            if bad:
                self._fail(bad)
            pytest.fail("growth check at your shape: " + "; ".join(growth), pytrace=False)
        return res

    def battery(self, dtype: str | None = None):
        """Run the default fixed battery adapted to the declared capabilities (and, with
        --ring-faults, the fault stage with those benign kinds); fail listing every failing case.
        With --ring-shape: the basics and the growth check at that shape instead (`at_shape`)."""
        from harness.checks.options import FAULT_STAGE_KINDS, CheckOptions, parse_kinds
        from harness.checks.stages import battery as battery_stage
        from harness.checks.stages import faults as fault_stage
        from harness.judging.verdicts import fault_ok

        if self.shape:
            return self.at_shape(dtype=dtype)

        caps = self._caps()
        cases, _ = battery_stage.plan(
            CheckOptions(impl=self.impl, world_size=self.world_size, dtype=dtype), caps
        )
        results = [self.run(c) for c in cases]
        bad = [r for r in results if not r.passed]
        kinds = (
            parse_kinds(self.faults, FAULT_STAGE_KINDS, "--ring-faults", ()) if self.faults else ()
        )
        if kinds:
            lo, hi = caps.world_sizes
            stage = fault_stage.plan(
                kinds, self.impl, caps, max_world=min(hi, 8), deadline_s=8.0, dtype=dtype
            )
            fault_results = [self.run(c) for c in stage if c.world_size >= lo]
            results += fault_results
            bad += [r for r in fault_results if not fault_ok(r)]
        if bad:
            self._fail(bad)
        return results


def chosen_impl(config: pytest.Config, node: pytest.Item) -> str:
    """The ring a test's `ring_check` runs: --ring-impl, else its ring_impl marker, else reference.

    When both name a ring and they differ, it warns (`RingImplOverride`), naming both. The text is
    the same for every test with that marker, so the summary lists them under one entry.
    """
    given = config.getoption("--ring-impl")
    marker = node.get_closest_marker("ring_impl")
    pinned = marker.args[0] if marker and marker.args else None
    if given and pinned and pinned != given:
        warnings.warn(
            RingImplOverride(
                f"--ring-impl {given} overrides @pytest.mark.ring_impl({pinned!r}): "
                f"the test runs {given}, not {pinned}"
            ),
            stacklevel=1,
        )
    return given or pinned or "reference"


@pytest.fixture
def ring_check(request: pytest.FixtureRequest, ring_pool) -> RingChecker:
    """Run cases on the session's rank pool against `chosen_impl`: --ring-impl, else the test's
    ring_impl marker."""
    return RingChecker(
        ring_pool,
        chosen_impl(request.config, request.node),
        request.config.getoption("--ring-world-size"),
        request.config.getoption("--ring-max-examples"),
        request.config.getoption("--ring-faults"),
        shape=request.config.getoption("--ring-shape"),
    )


# -- case files as test items -----------------------------------------------------------------


def _case_dirs(config: pytest.Config) -> list[Path]:
    dirs = [Path(d) for d in config.getoption("--ring-cases")] + list(config.getini("ring_cases"))
    return [d.resolve() for d in dirs]


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix not in (".yaml", ".yml"):
        return None
    if not any(d == file_path.parent or d in file_path.parents for d in _case_dirs(parent.config)):
        return None
    return CaseFile.from_parent(parent, path=file_path)


class CaseFile(pytest.File):
    def collect(self):
        item = CaseItem.from_parent(self, name=self.path.stem)
        if _needs_extra(self.path):
            # `-m extra` selects it with the adapter tests that need a library
            item.add_marker("extra")
        yield item


def _needs_extra(path: Path) -> bool:
    """Whether a case file names a built-in whose library is an optional extra. A file that does not
    load says False here: its item fails with the reason when it runs."""
    from harness import case as case_mod
    from harness.errors import HarnessError
    from harness.impls import registry

    try:
        case, _ = case_mod.load(path)
    except HarnessError:
        return False
    return registry.extra_of(case.impl) is not None


class CaseItem(pytest.Item):
    """Replays one saved case on --ring-impl (or on the implementation the case names, a built-in),
    by its `expect` field (harness.case.EXPECT): a saved failure must pass once its bug is fixed
    (the default); a `reproduce` case (the mutant corpus, a library's known bug) must reproduce its
    recorded verdict; under --ring-impl every case must pass. A case that cannot run here fails with
    the reason. One exception: without --ring-impl, a case of a built-in whose optional extra is not
    installed is skipped, naming the extra (the project's own corpus on the README's install,
    docs/ci.md)."""

    def runtest(self) -> None:
        from harness import case as case_mod
        from harness.checks.replay import replay_expectations
        from harness.impls import registry
        from harness.impls.capabilities import feature_words, unsupported

        case, data = case_mod.load(self.path)
        needs = data.get("impl_version")  # the library release a historical case needs
        given = self.config.getoption("--ring-impl")
        impl = given or case.impl
        if registry.is_module_path(impl) and not given:
            raise CaseReplayFailed(
                f"cannot run: it names implementation {impl!r}, a module path, "
                "and a case file "
                f"never imports code; pass --ring-impl {impl} (or your fixed "
                "ring)"
            )
        allow_import = registry.is_module_path(impl)
        try:
            resolved = registry.resolve(impl, allow_import=allow_import)
        except registry.MissingDependency as e:
            if given or registry.extra_of(impl) is None:
                raise CaseReplayFailed(f"cannot run on {impl}: {e}") from None
            if needs:  # the latest release would not run it either
                e = f"{e}; this case needs release {needs}: ci/historical/run.py installs it"
            pytest.skip(f"{self.path.name}: {e}")
        except registry.ImplError as e:  # an unknown name
            raise CaseReplayFailed(f"cannot run on {impl}: {e}") from None
        caps = resolved.capabilities
        if needs and not given and resolved.version != needs:
            pytest.skip(
                f"{self.path.name}: needs {impl} at release {needs} "
                f"(installed: {resolved.version}); ci/historical/run.py installs it"
            )
        # its own: as recorded (probe findings too)
        missing = unsupported(caps, case) if impl != case.impl else []
        if missing:
            words = "; ".join(
                feature_words(
                    f, caps, heads_q=case.heads_q, heads_kv=case.heads_kv, lengths=case.seq_lens
                )
                for f in missing
            )
            raise CaseReplayFailed(f"cannot run on {impl}: it does not declare {words}")
        problems = replay_expectations(
            self.path, _session_pool(self.session), impl=given, allow_import=allow_import
        )
        if problems:
            raise CaseReplayFailed("\n".join(problems))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseReplayFailed):
            return f"{self.path.name}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, 0, f"case {self.path.name}"


class CaseReplayFailed(AssertionError):
    pass


def _session_pool(session: pytest.Session):
    """Case items share one pool per pytest process, closed when the session ends."""
    pool = getattr(session, "_ring_harness_pool", None)
    if pool is None:
        from harness.ranks.backend import placement_of
        from harness.ranks.pool import RankPool

        opt = session.config.getoption
        pool = RankPool(
            size=1, placement=placement_of(opt("--ring-device"), opt("--ring-stage-p2p"))
        )
        session._ring_harness_pool = pool
        session.config.add_cleanup(pool.close)
    return pool
