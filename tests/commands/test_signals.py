"""SIGTERM (what CI cancellation and `timeout` send) mid-check: exit 143, the rank pools' temp dirs
removed, and a valid partial --json with what finished."""

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

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_mid_check_leaves_no_temp_dir_and_a_partial_json(tmp_path):
    pools = tempfile.mkdtemp(prefix="rh-sig-")  # short: the ranks' socket paths must fit
    try:
        env = dict(os.environ, RING_HARNESS_TMPDIR=pools)
        out = tmp_path / "r.json"
        p = subprocess.Popen([sys.executable, "-m", "harness", "check", "--world-size", "2", "--json", str(out),
                              "--save-dir", str(tmp_path / "f")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
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
            pytest.fail(f"the check did not exit within 60 s of SIGTERM: {''.join(seen)[-1500:]}{rest[-1500:]}")
        assert p.returncode == 143, "".join(seen) + rest
        assert "terminated (SIGTERM)" in rest
        assert os.listdir(pools) == []  # every pool dir (and the standby workers') removed
        data = json.loads(out.read_text())
        assert data["interrupted"] is True and len(data["results"]) >= 5
    finally:
        shutil.rmtree(pools, ignore_errors=True)
