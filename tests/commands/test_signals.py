"""SIGTERM (what CI cancellation and `timeout` send) mid-check: the signal only sets a flag
(harness.interrupt), the check stops at its next safe point: exit 143, the rank pools' temp dirs
removed, no worker left, and a valid partial --json with what finished."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness.ranks.leftovers import leftover_workers

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_mid_check_leaves_no_temp_dir_and_a_partial_json(tmp_path):
    pools = tempfile.mkdtemp(prefix="rh-sig-")  # short: the ranks' socket paths must fit
    try:
        env = dict(os.environ, RING_HARNESS_TMPDIR=pools)
        out = tmp_path / "r.json"
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                "check",
                "--world-size",
                "2",
                "--json",
                str(out),
                "--save-dir",
                str(tmp_path / "f"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen = []
        for line in p.stdout:  # wait until a few battery cases have finished
            seen.append(line)
            if line.lstrip().startswith("5/"):
                break
        p.send_signal(signal.SIGTERM)
        try:
            rest, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # kill it (its workers follow their parent), then fail
            p.kill()
            rest = p.communicate()[0]
            pytest.fail(
                "the check did not exit within 60 s of SIGTERM: "
                f"{''.join(seen)[-1500:]}{rest[-1500:]}"
            )
        assert p.returncode == 143, "".join(seen) + rest
        assert (
            "check INTERRUPTED by SIGTERM (exit 143)" in rest
            and "interrupted (SIGTERM); exit 143" in rest
        )
        assert os.listdir(pools) == []  # every pool dir (and the standby workers') removed
        data = json.loads(out.read_text())
        assert data["interrupted"] is True and len(data["results"]) >= 5
    finally:
        shutil.rmtree(pools, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("moment", range(20))
def test_sigterm_at_a_seeded_moment_stops_cleanly_within_10_s(tmp_path, moment):
    """Guards (slow: 20 checks, ~15 s each alone, ~27 s in the slow tier; issue #30 asks for 20)
    what no single moment does: wherever the signal lands (ranks starting, a battery case, between
    cases, the property-based search), the check exits within 10 s with exit 143 and a valid partial
    JSON, and leaves no worker and no temp dir behind."""
    import random
    import time

    # after the check's first line: battery, property
    delay = random.Random(2900 + moment).uniform(0.0, 14.0)
    pools = tempfile.mkdtemp(prefix="rh-sig-")
    try:
        env = dict(os.environ, RING_HARNESS_TMPDIR=pools)
        out = tmp_path / "r.json"
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness",
                "check",
                "--world-size",
                "2",
                "--no-growth",
                "--no-scale",
                "--fault-stage",
                "none",
                "--no-repeat",
                "--max-examples",
                "600",
                "--json",
                str(out),
                "--save-dir",
                str(tmp_path / "f"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = p.stdout.readline()  # the harness is up (its signal handlers installed)
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rest, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            rest = p.communicate()[0]
            pytest.fail(f"no exit within 30 s of SIGTERM at {delay:.1f} s: {rest[-2000:]}")
        took = time.monotonic() - t0
        assert took <= 10.0, f"exit {took:.1f} s after SIGTERM at {delay:.1f} s"
        if p.returncode == 0 or (p.returncode in (143, -signal.SIGTERM) and "check PASSED" in rest):
            # the check had finished before the signal: nothing to interrupt (600 examples outlast
            # the 14-s window on 2 loaded cores, but a signal landing after the verdict and the JSON
            # gets exit 143, or the default action in the interpreter's own exit; a check that
            # ignored it would fail the 10-s limit above)
            assert "check PASSED" in rest and json.loads(out.read_text())["interrupted"] is False
        else:
            assert p.returncode == 143, first + rest[-3000:]
            data = json.loads(out.read_text())
            assert data["interrupted"] is True and data["stopped"] == "interrupted by SIGTERM"
        time.sleep(0.5)
        # every worker of the check, forked or spawned, names it as its parent; and its zygote is
        # gone too
        assert (
            leftover_workers((), parent=p.pid, wait_s=5.0, scan=True) == []
            and os.listdir(pools) == []
        )
    finally:
        shutil.rmtree(pools, ignore_errors=True)
