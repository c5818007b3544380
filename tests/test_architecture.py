"""The architecture contracts (pyproject.toml [tool.importlinter], docs/architecture.md) hold on the
tree, and they are not vacuous: an upward import planted in a copy of the package breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(
    LINT is None, reason="import-linter is a dev dependency: pip install -e '.[dev]'"
)


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT, "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(cwd)},
    )


def _copy(tmp: Path) -> Path:
    for name in ("harness", "ring_impl"):
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def test_contracts_hold_on_the_tree(tmp_path):
    p = _lint(_copy(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        (
            "harness/ranks/worker.py",
            "from harness.judging import verdicts",
            "Rank-side code never imports",
        ),
        # the ranks compute the oracle's shares: the oracle is rank-side code, below the ranks
        (
            "harness/oracle/shares.py",
            "from harness.checks import report",
            "Rank-side code never imports",
        ),
        ("harness/oracle/tiles.py", "from harness.ranks import pool", "Layers"),
        ("harness/judging/tolerance.py", "from harness.checks import report", "Layers"),
        ("harness/case.py", "from harness.commands import cli", "Layers"),
    ],
)
def test_a_planted_upward_import_breaks_a_contract(tmp_path, module, planted, contract):
    root = _copy(tmp_path)
    path = root / module
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + planted + "  # planted\n" + rest)
    p = _lint(root)
    assert p.returncode != 0
    assert "Broken contracts" in p.stdout, p.stdout[-3000:]
    broken_section = p.stdout.split("Broken contracts", 1)[1]
    assert contract in broken_section, broken_section[:3000]
    assert module.removesuffix(".py").replace("/", ".") in broken_section
