"""The README's pytest-plugin example runs as written (its parametrized test, in a fresh
directory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plugin_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# tests/test_my_ring.py\n.*?)```", text, re.S)
    assert block, "README lost its pytest-plugin example"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_my_ring.py").write_text(block.group(1))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_my_ring.py",
            "-k",
            "causal",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={tmp_path / 'ring.xml'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "3 passed" in p.stdout
    assert (tmp_path / "ring.xml").read_text().count("<testcase") == 3
