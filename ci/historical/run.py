"""Real bugs at the versions they shipped in: the default check at each buggy and each fixed release.

Each release gets its own virtualenv, cached between runs. It holds the library and its pins only.
A `.pth` line adds the running interpreter's site-packages behind them. So torch and ring-harness
come from the environment that runs this script. The default `ring-harness check` then runs on
the library's adapter, and the bug's case file is replayed. One table comes out.

Run from the repository root, in the environment of the README's set-up:
    python ci/historical/run.py [--only ID] [--table FILE]
Not part of CI: it installs a dozen releases. Wall time and the table: docs/third-party.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BUGS = Path(__file__).with_name("bugs.yaml")
CACHE = Path(os.environ.get("RING_HARNESS_HISTORICAL_CACHE", "~/.cache/ring-harness/historical"))
NEEDED = {"id", "title", "link", "package", "impl", "buggy", "fixed", "cause", "case"}
FIELDS = NEEDED | {"pins", "env", "options", "at_fix"}


@dataclass
class Bug:
    """One real bug: the library, the adapter that runs it, the release with it and the one with
    its fix. `cause` is a part of the failure group's label that is this bug. `at_fix` names a
    failure that is still there at the fix, a bug of its own, with a reference."""

    id: str
    title: str
    link: str
    package: str
    impl: str
    buggy: str
    fixed: str
    cause: str
    case: str
    pins: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)
    at_fix: dict[str, str] = field(default_factory=dict)  # {cause, why}


@dataclass
class CheckRun:
    """The default check of one adapter at one release, read back from its JSON."""

    version: str
    exit: int | None = None  # None: it could not run
    wall_s: float = 0.0
    problem: str = ""  # why it could not run
    first_stage: str = ""  # the check's first failure: its stage and seconds
    first_s: float | None = None
    groups: list[dict] = field(default_factory=list)  # {label, stages: {stage: failing cases}}

    def group(self, cause: str) -> dict | None:
        return next((g for g in self.groups if cause in g["label"]), None)


def load_bugs(path: Path = BUGS) -> list[Bug]:
    """The bug list, validated: one clear line for a field that is missing or unknown."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    bugs = []
    for i, d in enumerate(data.get("bugs") or []):
        keys = set(d) if isinstance(d, dict) else set()
        if not keys >= NEEDED or not keys <= FIELDS:
            raise SystemExit(
                f"{path}: bug {i}: needs {sorted(NEEDED)}, may add {sorted(FIELDS - NEEDED)}; "
                f"got {sorted(keys)}"
            )
        bugs.append(Bug(**{k: (str(v) if k in ("buggy", "fixed") else v) for k, v in d.items()}))
    if len({b.id for b in bugs}) != len(bugs):
        raise SystemExit(f"{path}: bug ids repeat")
    return bugs


def env_dir(bug: Bug, version: str, cache: Path) -> Path:
    """The virtualenv of one release: named by the package, the version and a hash of the pins
    and of the base environment it stacks on, so two checkouts never share one."""
    key = " ".join([*sorted(bug.pins), sysconfig.get_paths()["purelib"]])
    return (
        cache.expanduser() / f"{bug.package}-{version}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    )


def base_problem() -> str:
    """Why this interpreter cannot be the base ('' when it can): torch and ring-harness must import."""
    for module in ("torch", "harness", "yaml"):
        try:
            __import__(module)
        except ImportError as e:
            return (
                f"{sys.executable} cannot import {module} ({e}): run it in the README's environment"
            )
    return ""


def ensure_env(bug: Bug, version: str, cache: Path) -> Path:
    """Create and fill the release's virtualenv once; later runs reuse it.

    The pins go in first, then the library, all with --no-deps: pip never resolves torch to a
    CUDA build, and each environment holds exactly what the list names. An sdist builds without
    isolation (it imports torch) and DeepSpeed with DS_BUILD_OPS=0.
    """
    d = env_dir(bug, version, cache)
    if (d / ".ready").exists():
        return d
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(d)], check=True)
    py = d / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([py, "-c", purelib], capture_output=True, text=True, check=True)
    base = sysconfig.get_paths()["purelib"]
    # an `import` line in a .pth runs: addsitedir also reads the base's .pth files (editable installs)
    Path(site.stdout.strip(), "zz-ring-harness-base.pth").write_text(
        f"import site; site.addsitedir({base!r})\n"
    )
    env = {**os.environ, "DS_BUILD_OPS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for what in (bug.pins, [f"{bug.package}=={version}"]):
        if what:
            cmd = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *what]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"pip install {' '.join(what)}: {done.stderr.strip()[-300:]}")
    # ready only when the adapter is: `ring-harness impls` lists it as such
    impls = subprocess.run(
        [py, "-m", "harness", "impls"], capture_output=True, text=True, env=_env(bug), cwd=ROOT
    )
    row = next((x for x in impls.stdout.splitlines() if x.split()[:1] == [bug.impl]), "")
    if " ready " not in row:
        raise RuntimeError(f"{bug.impl} not runnable in {d}: {row or impls.stderr.strip()[-300:]}")
    (d / ".ready").write_text(" ".join([f"{bug.package}=={version}", *bug.pins]) + "\n")
    return d


def _env(bug: Bug) -> dict[str, str]:
    return {**os.environ, **{k: str(v) for k, v in bug.env.items()}}


def run_check(bug: Bug, version: str, a: argparse.Namespace) -> CheckRun:
    """The default check of the bug's adapter at one release, into `a.out`.

    With `a.reuse`, a check already run into `a.out` is read back, not run again.
    """
    run = CheckRun(version=version)
    print(
        f"{bug.package} {version}: virtualenv, then `ring-harness check --impl {bug.impl}`",
        flush=True,
    )
    try:
        d = ensure_env(bug, version, a.cache)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        run.problem = str(e)
        return run
    opts = "-" + hashlib.sha1(" ".join(bug.options).encode()).hexdigest()[:6] if bug.options else ""
    stem = a.out / f"{bug.impl}-{version}{opts}"
    js, meta, log = (stem.with_name(stem.name + x) for x in (".json", ".run.json", ".log"))
    if a.reuse and meta.exists():
        m = json.loads(meta.read_text())
        run.exit, run.wall_s, run.problem = m["exit"], m["wall_s"], m["problem"]
    else:
        cmd = [d / "bin" / "python", "-m", "harness", "check", "--impl", bug.impl, "--json", js]
        cmd += ["--save-dir", stem.with_name(stem.name + "-cases"), *bug.options]
        js.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8") as fh:
            try:
                run.exit = subprocess.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(bug), cwd=ROOT,
                    timeout=a.timeout,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                run.problem = f"the check passed its {a.timeout:.0f} s limit (log: {log})"
        run.wall_s = time.perf_counter() - t0
        if (run.exit not in (0, 1) or not js.exists()) and not run.problem:
            run.problem = f"exit {run.exit}: {_last_line(log)}"
        meta.write_text(
            json.dumps({"exit": run.exit, "wall_s": run.wall_s, "problem": run.problem})
        )
    if js.exists():
        data = json.loads(js.read_text())
        first = data.get("first_failure") or {}
        run.first_stage, run.first_s = first.get("stage", ""), first.get("seconds")
        run.groups = [
            {"label": str(g.get("label", "?")), "stages": dict(g.get("stages", {}))}
            for g in data.get("failure_groups", [])
        ]
    return run


def _last_line(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "no output"


def replay(bug: Bug, version: str, a: argparse.Namespace) -> str:
    """The verdict the bug's case file gives at this release (its `impl_version` aside)."""
    d = env_dir(bug, version, a.cache)
    if not (d / ".ready").exists():
        return "not installed"
    js = a.out / f"{bug.id}-{version}-replay.json"
    js.unlink(missing_ok=True)
    cmd = [d / "bin" / "python", "-m", "harness", "replay", ROOT / bug.case, "--json", js]
    try:
        subprocess.run(cmd, capture_output=True, env=_env(bug), cwd=ROOT, timeout=300)
    except subprocess.TimeoutExpired:
        return "replay timed out"
    return str(json.loads(js.read_text()).get("verdict", "?")) if js.exists() else "no replay"


@dataclass
class Row:
    bug: Bug
    bad: CheckRun
    good: CheckRun
    bad_case: str
    good_case: str

    @property
    def found(self) -> bool:
        """The check fails with a group of the bug's cause, and its case fails at that release."""
        group = self.bad.group(self.bug.cause)
        return self.bad.exit == 1 and group is not None and self.bad_case not in ("pass", "")

    @property
    def fixed(self) -> bool:
        """The case passes at the fix, and so does the check, but for a known other bug."""
        if self.good_case != "pass" or self.good.exit not in (0, 1):
            return False
        other = self.bug.at_fix.get("cause")
        return self.good.exit == 0 or all(other and other in g["label"] for g in self.good.groups)

    def cells(self) -> list[str]:
        b, bad, good = self.bug, self.bad, self.good
        g = bad.group(b.cause)
        stages = "; ".join(f"{s} {n}" for s, n in g["stages"].items()) if g else ""
        found = f"found: {g['label']} ({stages})" if g else "NOT FOUND"
        if bad.problem:
            found = f"cannot run: {bad.problem}"
        first = f"{bad.first_stage}, {bad.first_s:.0f} s" if bad.first_s is not None else "-"
        if good.problem:
            at_fix = f"cannot run: {good.problem}"
        elif good.exit == 0:
            at_fix = "pass"
        elif self.fixed:
            at_fix = f"its case passes; the check still fails: {b.at_fix.get('why', '')}"
        else:
            at_fix = "FAIL: " + "; ".join(x["label"] for x in good.groups)
        return [
            f"{b.title} ([link]({b.link}))",
            f"{b.package} {b.buggy}",
            found,
            first,
            self.bad_case,
            f"{b.package} {b.fixed}",
            at_fix,
            self.good_case,
        ]


HEADER = [
    "| bug | with the bug | default check: the bug's failure group (stages) | check's first failure "
    "| case replay | with the fix | default check | case replay |",
    "|---|---|---|---|---|---|---|---|",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Bug ids: ci/historical/bugs.yaml. The cache may also be set by "
        "$RING_HARNESS_HISTORICAL_CACHE.",
    )
    p.add_argument(
        "--only", action="append", help="a bug id of ci/historical/bugs.yaml (repeatable)"
    )
    p.add_argument("--cache", type=Path, default=CACHE, help="where the virtualenvs live")
    p.add_argument("--out", type=Path, default=Path("historical-out"), help="logs, JSON, cases")
    p.add_argument("--table", type=Path, help="also write the table (markdown) here")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per check")
    p.add_argument("--reuse", action="store_true", help="read back checks already run into --out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    problem = base_problem()
    if problem:
        print(f"historical: {problem}")
        return 2
    bugs = load_bugs()
    unknown = set(a.only or []) - {b.id for b in bugs}
    if unknown:
        print(f"--only: unknown bug id(s) {sorted(unknown)}; known: {[b.id for b in bugs]}")
        return 2
    bugs = [b for b in bugs if not a.only or b.id in a.only]
    a.out.mkdir(parents=True, exist_ok=True)
    t0, lines, bad_rows = time.perf_counter(), list(HEADER), 0
    checks: dict[tuple, CheckRun] = {}  # bugs of one release share its check
    for b in bugs:
        runs = []
        for v in (b.buggy, b.fixed):
            key = (b.impl, v, tuple(b.options))
            if key not in checks:
                checks[key] = run_check(b, v, a)
            runs.append(checks[key])
        print(f"{b.id}: replaying {b.case} at {b.buggy} and {b.fixed}", flush=True)
        row = Row(b, *runs, replay(b, b.buggy, a), replay(b, b.fixed, a))
        bad_rows += not (row.found and row.fixed)
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row.cells()) + " |")
        verdict = (
            f"{'found' if row.found else 'NOT FOUND'}, {'fixed' if row.fixed else 'NOT FIXED'}"
        )
        print(f"{b.id}: {verdict}", flush=True)
    wall = time.perf_counter() - t0
    lines.append(f"\n{len(bugs)} bug(s), {bad_rows} not found-then-fixed; wall {wall:.0f} s")
    print("\n".join(lines))
    if a.table:
        a.table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
