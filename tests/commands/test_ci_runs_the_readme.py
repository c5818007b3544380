"""CI runs the README's set-up and test commands exactly as written, in the README's environment
(issue #39).

A new contributor runs those two lines first. CI must run the same lines, before it installs
anything of its own, so that a red README is a red CI.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_setup() -> tuple[str, str]:
    """(the install command, the test command) of the README's Install section, comments dropped."""
    section = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the README's Install section lost its bash block"
    lines = [re.sub(r"\s+#.*$", "", ln).strip() for ln in block.group(1).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert len(lines) == 2, f"expected the install and the test command, got {lines}"
    return lines[0], lines[1]


def ci_lines() -> list[str]:
    return [ln.strip() for ln in (ROOT / "ci" / "run-cpu.sh").read_text().splitlines()]


def test_the_readme_has_an_install_and_a_test_command():
    install, tests = readme_setup()
    assert "pip install" in install and "python3 -m venv" in install
    assert tests.startswith("python -m pytest")


def test_ci_runs_both_verbatim_before_it_installs_anything_else():
    install, tests = readme_setup()
    lines = ci_lines()
    assert install in lines, (
        f"ci/run-cpu.sh no longer runs the README's install line as written: {install}"
    )
    assert tests in lines, (
        f"ci/run-cpu.sh no longer runs the README's test command as written: {tests}"
    )
    at_install, at_tests = lines.index(install), lines.index(tests)
    pips = [i for i, ln in enumerate(lines) if "pip install" in ln and not ln.startswith("#")]
    assert pips[0] == at_install, (
        "ci/run-cpu.sh installs something before the README's install line"
    )
    assert at_install < at_tests, "the README's test command runs before its install line"
    extras = [i for i in pips if i > at_install]
    assert extras and at_tests < extras[0], (
        "the extras are installed before the README's test command runs"
    )


def test_ci_enters_no_environment_of_its_own_before_the_readme():
    code = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if not ln.lstrip().startswith("#")
    ]
    assert "exec bash ci/run-cpu.sh" in code
    assert not [ln for ln in code if re.search(r"\bvenv\b|\bpip\b|activate", ln)], code
