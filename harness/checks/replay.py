"""Replaying a saved case: does the recorded verdict reproduce, and (for a deterministic
implementation on the same torch) do the output hashes match bit for bit? `replay(ReplayOptions)` is
`ring-harness replay` as a library call; `replay_on(pool, path)` re-runs a file on a pool you hold.

A sequence file (harness.case_sequence.CaseSequence: the reproducer of a failure that depends on
what ran before it, harness.search.history) runs its cases in order on fresh ranks (the pool is
restarted first) and its last case is judged and compared with the record."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from harness import case as case_mod
from harness import case_sequence
from harness.case import Case
from harness.checks import report
from harness.checks.options import ReplayOptions
from harness.checks.report import Reporter
from harness.checks.stages import property as prop_stage
from harness.diagnose import localise
from harness.errors import HarnessError
from harness.impls import registry
from harness.judging.verdicts import fault_ok
from harness.oracle.mode import oracle_mode
from harness.ranks.launch import open_pool
from harness.result import CaseResult, Verdict, cpu_platform
from harness.runner import check_memory, run_case
from harness.search import history
from harness.search.fuzz import impl_info

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool


@dataclass
class Replay:
    """The outcome of replaying one case file."""

    result: CaseResult
    recorded_verdict: str | None
    hash_mismatches: list[str] = field(default_factory=list)
    hashes_compared: int = 0
    hash_note: str = ""
    localisation: object | None = None  # harness.diagnose.localise.Localisation of a failing replay
    sequence: int = 0  # cases in a sequence file (0: a single case)
    recorded_errors: dict = field(default_factory=dict)  # rank -> the recorded one-line error

    @property
    def correct(self) -> bool:
        """The exit status's verdict: a pass, or the end a correct ring makes under the faults.

        A scheduled drop must end in a fail-stop; that is the ring working, not wrong.
        """
        r = self.result
        return r.passed or (bool(r.case.faults) and fault_ok(r))

    @property
    def verdict_reproduced(self) -> bool:
        """The recorded verdict again, and for a raising ring an error of a recorded class.

        A fail-stop from an import error is not the recorded RuntimeError (#44: a release that
        needs an environment variable to import).
        """
        if self.recorded_verdict is None:
            return True
        if self.result.verdict != self.recorded_verdict:
            return False
        was, now = error_classes(self.recorded_errors), error_classes(self.result.errors)
        return not was or not now or bool(was & now)


def error_classes(errors: dict) -> set[str]:
    """The exception class names that start the one-line errors ('RuntimeError: ...')."""
    found = (
        re.match(r"([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)):", str(e))
        for e in errors.values()
    )
    return {m.group(1) for m in found if m}


def compare_hashes(recorded: dict, result: CaseResult) -> tuple[int, list[str]]:
    """(number of shard hashes compared, descriptions of those that differ)."""
    compared, bad = 0, []
    for rank, tensors in (recorded or {}).items():
        got = result.hashes.get(int(rank), {})
        for name, h in tensors.items():
            if name in got:
                compared += 1
                if got[name] != h:
                    bad.append(f"{name}@rank{rank}: recorded {h}, now {got[name]}")
    return compared, bad


def replay_on(
    pool: Pool, path: str | os.PathLike, impl: str | None = None, *, allow_import: bool = False
) -> Replay:
    """Re-run a case file (optionally under another implementation) and compare with its record; a
    sequence file runs in order on the pool restarted (fresh ranks), `impl` replacing the
    implementation of the members that name the last one's."""
    case, data = case_mod.load(path)
    recorded = case_mod.recorded_result(data)
    name = impl or case.impl
    n = 0
    if case_mod.is_sequence(data):
        seq, _ = case_sequence.load_sequence(path)
        n = len(seq.steps)
        res = history.run_file_sequence(pool, seq, impl, allow_import=allow_import)
        if res is None:
            raise HarnessError(
                f"{path}: an earlier case of the sequence hung or killed a rank; "
                "the last was not run"
            )
    else:
        history.forget_baseline(case, name)  # computed here, as in a fresh process
        res = run_case(case, pool, name, allow_import=allow_import)
    out = Replay(
        result=res,
        recorded_verdict=recorded.get("verdict") if impl in (None, case.impl) else None,
        sequence=n,
        recorded_errors=dict(recorded.get("errors") or {}),
    )
    if out.recorded_verdict is not None and recorded.get("hashes"):
        out.hashes_compared, out.hash_mismatches = compare_hashes(recorded["hashes"], res)
        out.hash_note = hash_note(recorded.get("versions", {}))
    return out


def hash_note(versions: dict) -> str:
    """Why recorded hashes are for information only here ('' when they must match): another
    torch, or another CPU platform (its kernels may round differently: `cpu_platform`), or none
    recorded."""
    if versions.get("torch") != str(torch.__version__):
        return (
            f"recorded on torch {versions.get('torch')}, replayed on {torch.__version__}: "
            "hashes compared for information only"
        )
    here = cpu_platform()
    if versions.get("platform") != here:
        was = versions.get("platform") or "a CPU platform not recorded"
        return f"recorded on {was}, replayed on {here}: hashes compared for information only"
    return ""


def replay_expectations(
    path: str | os.PathLike, pool: Pool, *, impl: str | None = None, allow_import: bool = False
) -> list[str]:
    """Problems with a saved case (empty list = fine), by its `expect` field (harness.case.EXPECT):
    `reproduce`: the recorded verdict must reproduce, with identical hashes on the same torch, and
    the case must pass on the reference; `pass` (a user's saved failure as a regression test): it
    must pass now, and when it does not, the recorded verdict is shown as history. Under another
    implementation (`impl`, e.g. the fixed ring) every case must pass: the corpus is a regression
    suite for any ring."""
    loaded, data = case_mod.load(path)
    other = impl is not None and impl != loaded.impl
    name = loaded.impl if allow_import else None
    if other:
        name = impl
    rp = replay_on(pool, path, name, allow_import=allow_import)
    problems = []
    case, r = rp.result.case, rp.result
    who = impl if other else case.impl
    if other or data.get("expect", "pass") == "pass":
        if not r.passed:
            recorded = (
                case_mod.recorded_result(data).get("verdict") if other else rp.recorded_verdict
            )
            was = ""
            if other and recorded:
                was = f" (recorded on {loaded.impl}: {recorded})"
            elif recorded not in (None, "pass"):
                was = f" (recorded: {recorded}; the bug this case was saved for is still there)"
            problems.append(f"{who}: expected pass, got {r.verdict}{was}: {r.detail}")
        return problems
    if not rp.verdict_reproduced:
        problems.append(
            f"{case.impl}: recorded verdict {rp.recorded_verdict}, got {r.verdict} ({r.detail})"
        )
    elif rp.recorded_verdict is None and not r.passed:
        problems.append(f"{case.impl}: expected pass, got {r.verdict} ({r.detail})")
    if rp.hash_mismatches and not rp.hash_note:
        problems.append(
            "output hashes differ from the record: " + "; ".join(rp.hash_mismatches[:4])
        )
    if case.impl != "reference":
        # the same sequence with the reference in place of the implementation, on fresh ranks
        if rp.sequence:
            seq, _ = case_sequence.load_sequence(path)
            ref = history.run_file_sequence(pool, seq, "reference")
            if ref is None:
                problems.append("reference: an earlier case of the sequence hung or killed a rank")
                return problems
        else:
            ref = run_case(case, pool, "reference")
        if not ref.passed:
            problems.append(f"reference: expected pass, got {ref.verdict} ({ref.detail})")
    return problems


def hash_line(rp: Replay, deterministic: bool) -> str:
    """Whether the output hashes match the record, in words."""
    if rp.recorded_verdict is None:
        return "hashes: not compared (no record for this implementation)"
    if not rp.hashes_compared:
        return "hashes: none recorded to compare"
    if not rp.hash_mismatches:
        return f"hashes: all {rp.hashes_compared} output shards match the record bit for bit"
    why = rp.hash_note or (
        "" if deterministic else "the implementation declares itself non-deterministic"
    )
    head = f"hashes: {len(rp.hash_mismatches)} of {rp.hashes_compared} output shards DIFFER from the record"
    return (
        head
        + (f" ({why})" if why else "")
        + "\n"
        + "\n".join(f"        {m}" for m in rp.hash_mismatches[:8])
    )


def replay(opts: ReplayOptions, reporter: Reporter | None = None) -> Replay:
    """`ring-harness replay` as a library call: re-run the case file on fresh local ranks, print the
    row, details, localisation and whether the record reproduces (write opts.json); `.result.passed`
    is the exit status's verdict."""
    opts = opts.validate()
    out = reporter or report.out
    path = Path(opts.case)
    case, data = case_mod.load(path)
    seq = case_sequence.load_sequence(path)[0] if case_mod.is_sequence(data) else None
    impl = opts.impl or case.impl
    _refuse_module_paths(path, case, seq, given=opts.impl is not None)
    allow_import = registry.is_module_path(impl)
    registry.resolve(impl, allow_import=allow_import)  # a missing optional extra: one line, exit 2
    recorded = case_mod.recorded_result(data)
    _, version = impl_info(impl, allow_import)
    deterministic = _deterministic(impl, allow_import)
    for c in [s.case for s in seq.steps] if seq is not None else [case]:
        check_memory(c, opts.oracle)  # before any rank starts
    for line in _intro_lines(path, impl, case, recorded, seq):
        out(line)
    with (
        open_pool(
            "local",
            opts.backend,
            seq.pool_size if seq is not None else case.pool_size,
            opts.placement,
        ) as pool,
        oracle_mode(opts.oracle),
    ):
        rp = replay_on(pool, path, impl if opts.impl else None, allow_import=allow_import)
        rp.localisation = _print_replay(out, rp, pool, opts, seq, deterministic)
    if opts.json:
        _write_json(opts.json, path, impl, version, rp)
    return rp


def _refuse_module_paths(
    path: Path, case: Case, seq: case_sequence.CaseSequence | None, given: bool
) -> None:
    """A case file never imports code by itself: a module path must come from --impl."""
    if not given and registry.is_module_path(case.impl):
        raise HarnessError(
            f"{path} names implementation {case.impl!r}, a module path; a case file "
            "never imports "
            f"code by itself, so give it on the command line: --impl {case.impl}"
        )
    for s in seq.steps if seq is not None else ():
        if s.case.impl != case.impl and registry.is_module_path(s.case.impl):
            raise HarnessError(
                f"{path}: an earlier case of the sequence names implementation "
                f"{s.case.impl!r}, a "
                "module path; only the last case's implementation can be given with "
                "--impl"
            )


def _intro_lines(
    path: Path,
    impl: str,
    case: Case,
    recorded: dict | None,
    seq: case_sequence.CaseSequence | None,
) -> list[str]:
    """What is replayed: the file and implementation, the record, a sequence's earlier cases."""
    lines = [
        f"replay {path}: impl {impl}"
        + (f" (recorded for {case.impl})" if impl != case.impl else "")
    ]
    if recorded:
        v = recorded.get("versions", {})
        lines.append(
            f"recorded: {recorded.get('verdict')} (torch {v.get('torch')}, ring-harness "
            f"{v.get('ring-harness')}, impl {v.get('impl')}, backend "
            f"{recorded.get('backend')})"
        )
    if seq is not None:
        n = len(seq.steps)
        lines.append(
            f"a sequence of {n} cases, run in order on fresh ranks; the last one is judged (a "
            "failure that "
            "depends on what ran before it on the same ranks)"
        )
        for i, s in enumerate(seq.steps[:-1], 1):
            lines.append(
                f"    {i}/{n}  {s.case.summary()}  "
                f"[{s.case.impl}{'' if s.leak else ', no leak run'}]"
            )
    return lines


def _print_replay(
    out: Reporter,
    rp: Replay,
    pool: Pool,
    opts: ReplayOptions,
    seq: case_sequence.CaseSequence | None,
    deterministic: bool,
) -> localise.Localisation | None:
    """Print the replayed row, its localisation, the verdict and hash lines, and any heatmaps.

    Returns the localisation of a failing single case (None otherwise).
    """
    r = rp.result
    out(report.header())
    out(report.row(rp.sequence or 1, rp.sequence or 1, r))
    for line in report.details(r):
        out(line)
    loc = None
    if seq is not None and not r.passed:
        out(
            "        localisation: not run for a sequence (re-running its last case on these "
            "ranks would run "
            "after it, not in its place)"
        )
    elif not r.passed and r.checks:
        loc = localise.localise(r, pool, probes=bool(opts.plot))
        for line in localise.lines(loc):
            out(line)
    out(_verdict_line(rp))
    out(hash_line(rp, deterministic))
    if opts.plot and loc is not None and loc.blocks:
        for p in prop_stage.plot(loc, opts.plot, Path(opts.case).stem):
            out(f"heatmap {p}")
    elif opts.plot and loc is not None and rp.result.case.serving is not None:
        out("no heatmap: a serving case is localised by its worst values, not by key block (#54)")
    return loc


def _verdict_line(rp: Replay) -> str:
    """The replayed verdict, and whether it reproduces the recorded one."""
    r = rp.result
    if r.verdict == Verdict.INVALID:
        return f"verdict: {r.verdict}: {r.detail or 'the case tested nothing'}"
    if not r.passed and rp.correct:
        return f"verdict: {r.verdict}, as its faults require of a correct ring"
    if rp.recorded_verdict is None:
        return f"verdict: {r.verdict}"
    if rp.verdict_reproduced:
        return f"verdict: {r.verdict}: reproduces the recorded verdict"
    if r.verdict == rp.recorded_verdict:
        was, now = error_classes(rp.recorded_errors), error_classes(r.errors)
        return (
            f"verdict: {r.verdict}: does NOT reproduce the recorded error "
            f"(recorded {', '.join(sorted(was))}; now {', '.join(sorted(now))})"
        )
    return f"verdict: {r.verdict}: does NOT reproduce the recorded verdict {rp.recorded_verdict}"


def _write_json(path: str, case_path: Path, impl: str, version: str, rp: Replay) -> None:
    """The replay's machine-readable results (--json)."""
    r, loc = rp.result, rp.localisation
    report.write_json(
        path,
        {
            "command": "replay",
            "case": str(case_path),
            "impl": impl,
            "impl_version": version,
            "recorded_verdict": rp.recorded_verdict,
            "verdict": r.verdict,
            "reproduced": rp.verdict_reproduced,
            "hashes_compared": rp.hashes_compared,
            "hash_mismatches": rp.hash_mismatches,
            "result": r.to_dict(),
            "localisation": None if loc is None else localise.summary(loc),
        },
    )


def _deterministic(impl: str, allow_import: bool) -> bool:
    try:
        from harness.impls import registry

        return bool(registry.resolve(impl, allow_import=allow_import).deterministic)
    except (ImportError, HarnessError):
        return True
