"""Every command and code block of the README and docs/ runs as written (issues #18, #30).

The bash blocks of README.md and docs/*.md are extracted (continuation lines joined, comments
dropped) and each command must appear in COMMANDS with how it is run: in the default tier, in the
slow tier (`--run-slow`, CI runs both), or not at all with the reason. A command added without an
entry fails `test_every_documented_command_is_classified`. Commands run in a fresh directory (so
their outputs, e.g. `ring-harness-failures/`, `selftest.json`, `plots/`, never land in the
repository) that links the repository's `cases/` and holds the docs' example modules
(`myring.py`, `mydecode.py`); placeholders are filled in as noted. The Python blocks run as scripts, the case-file
example loads as a valid case and the fault list as valid faults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
ALL = "\n".join(DOCS.values())


def documented_modules() -> dict[str, str]:
    """The docs' example modules: each Python block that starts `# NAME.py`, by file name."""
    found = re.findall(r"```python\n# (\w+\.py)(.*?)```", ALL, re.S)
    return {name: f"# {name}{body}" for name, body in found}


def my_ring_example(text: str = README) -> str:
    """The README's adapter example, as written (the block that starts with `# myring.py`)."""
    block = re.search(r"```python\n(# myring\.py.*?)```", text, re.S)
    assert block, "the README lost its adapter example"
    return block.group(1)


SETUP = "skip: CI's set-up, run verbatim first in a fresh clone (tests/commands/test_ci_runs_the_readme.py)"
# command as written -> (tier, expected exit status, the command actually run or None = as written)
#   tier: "fast" (default suite), "slow" (--run-slow), or "skip: <why it cannot run in the suite>"
COMMANDS: dict[str, tuple[str, int | None, str | None]] = {
    "python3 -m venv .venv": (SETUP, None, None),
    ". .venv/bin/activate": (SETUP, None, None),
    "pip install -r ci/requirements-cpu.txt": (SETUP, None, None),
    "pip install -e '.[dev]'": (SETUP, None, None),
    "ring-harness check": ("slow", 0, None),
    # the README's adapter example, end to end
    # 50 property-based examples (~190 s with the ci profile's 300, ~118 s with 100); the
    # reference's whole default check is the command above
    "ring-harness check --impl myring:my_ring": (
        "slow",
        0,
        "ring-harness check --impl myring:my_ring --max-examples 50",
    ),
    "python -m pytest -n 2": (
        "skip: it is this test suite, which CI runs verbatim in the README's "
        "environment "
        "(tests/commands/test_ci_runs_the_readme.py)",
        None,
        None,
    ),
    # the mutant's failure
    "ring-harness replay cases/mutant-causal-step-off-by-one.yaml": ("fast", 1, None),
    "ring-harness replay CASE.yaml --impl reference --plot plots/": (
        "fast",
        0,
        "ring-harness replay cases/mutant-causal-step-off-by-one.yaml --impl reference "
        "--plot plots/",
    ),
    "ring-harness check --faults all --fault-cases 200": (
        "skip: the same command, its battery and fault stage only, runs in "
        "tests/checks/test_fault_battery.py::test_200_faulted_cases_no_hang_no_leftover "
        "(slow tier), which also checks that no process is left",
        None,
        None,
    ),
    "torchrun --standalone --nproc-per-node 8 -m harness check --launcher torchrun --world-size 8": (
        "skip: 8 NCCL ranks on one GPU host; the torchrun path runs on gloo in "
        "tests/ranks/test_torchrun.py",
        None,
        None,
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 "
    "--rdzv-id ring-harness-1 -m harness check --launcher torchrun --world-size 16 --impl "
    "ring-flash-attn-zigzag": ("skip: two GPU nodes", None, None),
    # the README's two hosts: tests/ranks/test_multihost.py runs them as two agents on this machine
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank NODE_RANK --master-addr NODE0_HOST "
    "--master-port 29500 -m harness check --launcher torchrun --world-size 16": (
        "skip: two GPU hosts; two gloo agents on one machine run it in tests/ranks/test_multihost.py",
        None,
        None,
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 "
    "--rdzv-id ring-harness-1 -m harness check --launcher torchrun --world-size 16": (
        "skip: two GPU hosts; the static rendezvous's form runs in tests/ranks/test_multihost.py",
        None,
        None,
    ),
    "ring-harness impls": ("fast", 0, None),
    # docs/serving.md's decode attention, written for the docs: its default check, training and
    # serving cases, every stage, at 50 property-based examples (47 s in CI with the ci profile's
    # 300). It is the suite's only whole check of a serving ring.
    "ring-harness check --impl mydecode:decode": (
        "fast",
        0,
        "ring-harness check --impl mydecode:decode --max-examples 50",
    ),
    # the README's all-gather ring is O(n): exit 1, and `_readme_ring_is_o_of_n` reads the verdicts
    # from the JSON; run at W <= 4, 32 tokens a rank and without the straggler timing. ~45 s: slow
    # tier (#55); the profile command's exit and verdicts stay in the default suite
    # (tests/profiling/test_profile.py)
    "ring-harness profile --impl myring:my_ring --impl reference --trace profile/": (
        "slow",
        1,
        "ring-harness profile --impl myring:my_ring --impl reference --trace profile/ "
        "--max-world-size 4 --straggler 0 --tokens-per-rank 32 --json profile.json",
    ),
    # no GPU here: both are refused in one line, exit 2 (tests/commands/test_gpu_check.py runs the
    # script on CPU)
    "ring-harness check --device cuda --world-size 8": ("fast", 2, None),
    "ring-harness profile --device cuda --impl myring:my_ring --impl reference "
    "--max-world-size 4": ("fast", 2, None),
    "torchrun --standalone --nproc-per-node 4 -m harness check --launcher torchrun --backend nccl "
    "--share-gpu --world-size 4": (
        "skip: NCCL ranks on a GPU; a lent H200 ran it (docs/gpu/2026-11-28-h200-nccl/), and its "
        "refusals run in tests/ranks/test_share_gpu.py",
        None,
        None,
    ),
    "python scripts/gpu_check.py --out gpu-report --device cuda": (
        "fast",
        2,
        f"{sys.executable} {ROOT / 'scripts' / 'gpu_check.py'} --out gpu-report --device cuda",
    ),
    # refused up front, one line
    "ring-harness check --shape b1,hq32,hkv8,d128,L8192,W8": ("fast", 2, None),
    "ring-harness check --shape b1,hq8,hkv2,d128,L520,W4 --dtype bf16": ("slow", 0, None),
    "ring-harness selftest": (
        "skip: the whole zoo through the default check, ~15 min on 2 cores: "
        "run before resolving "
        "an issue (named in the closing note); the slow tier runs a subset "
        "with a mutant "
        "killed by each stage (the next command)",
        None,
        None,
    ),
    # the reference's false-alarm side is `ring-harness check` above (the same default check)
    "ring-harness selftest --only "
    "naive-merge-sum,out-merge-in-input-dtype,tile-tail-dropped,read-before-wait "
    "--json selftest.json": ("slow", 0, None),
    "ring-harness selftest --only reference --false-alarm-cases 2000": (
        "skip: 2,000 property-based cases (10-20 min on 2 cores); the same false-alarm side runs "
        "with the ci "
        "budget in `ring-harness selftest` above and in scripts/calibrate.py",
        None,
        None,
    ),
}


def readme_commands(text: str = ALL) -> list[str]:
    """The commands of the bash blocks of README.md and docs/*.md: continuation lines joined,
    comments and blanks dropped, `a && b` as two commands."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            out += [re.sub(r"\s+", " ", c.strip()) for c in line.split("&&") if c.strip()]
    return list(dict.fromkeys(out))


def test_every_documented_command_is_classified():
    found = readme_commands()
    assert found, "the README lost its bash blocks"
    missing = [c for c in found if c not in COMMANDS]
    stale = [c for c in COMMANDS if c not in found]
    assert not missing, (
        f"documented commands with no entry in COMMANDS (run them or say why not): {missing}"
    )
    assert not stale, f"COMMANDS entries README.md and docs/ no longer have: {stale}"


def _argv(command: str) -> list[str]:
    import shlex

    argv = shlex.split(command)
    # not installed as a script
    if argv[0] == "ring-harness" and shutil.which("ring-harness") is None:
        argv = [sys.executable, "-m", "harness", *argv[1:]]
    return argv


def _run_command(command: str, tmp_path: Path) -> None:
    tier, code, actual = COMMANDS[command]
    (tmp_path / "cases").symlink_to(ROOT / "cases")
    for name, text in documented_modules().items():
        (tmp_path / name).write_text(text)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    p = subprocess.run(
        _argv(actual or command),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=1500 if tier == "slow" else 300,
    )
    assert p.returncode == code, (
        f"{command}: exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    )
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    print(f"{command}: exit {p.returncode}; last line: {last}")
    if command in AFTER:
        AFTER[command](tmp_path)


def _readme_ring_is_o_of_n(tmp_path: Path) -> None:
    """The README's own example ring (torch's differentiable all_gather), profiled from its own
    directory: O(n) in memory and over length, and its backward's traffic counted."""
    rings = json.loads((tmp_path / "profile.json").read_text())["rings"]
    mine = next(r for r in rings if r["impl"] == "myring:my_ring")
    assert mine["memory"]["verdict"] == "O(n): gathers K/V"
    assert mine["broken"][0].startswith("memory")
    assert mine["memory"]["length"]["verdict"] == "O(n): gathers K/V"
    # its backward: gloo's differentiable all-to-all, W scatters a rank, each root sending 3/4
    assert mine["traffic"]["backward"]["messages"] == 8 and mine["traffic"]["backward"]["sent"] > 0


# what a command's run must also show, read from what it wrote
AFTER = {
    "ring-harness profile --impl myring:my_ring --impl reference --trace profile/": (
        _readme_ring_is_o_of_n
    ),
}


@pytest.mark.parametrize("command", [c for c, v in COMMANDS.items() if v[0] == "fast"])
def test_readme_command_runs_as_written(command, tmp_path):
    _run_command(command, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c, v in COMMANDS.items() if v[0] == "slow"])
def test_readme_command_runs_as_written_slow(command, tmp_path):
    _run_command(command, tmp_path)


@pytest.mark.slow
def test_documented_python_blocks_run(tmp_path):
    """Every Python block of README.md and docs/ runs as a script (the pytest-plugin example runs
    under pytest: tests/commands/test_readme.py); the adapter example is imported and run on two
    ranks. ~45 s, slow tier (#55): six interpreters, three of them checks."""
    blocks, seen = [], set()
    for name, text in DOCS.items():  # a block shown in two places runs once
        for b in re.findall(r"```python\n(.*?)```", text, re.S):
            if not b.startswith("# tests/") and b.strip() not in seen:
                seen.add(b.strip())
                blocks.append((name, b))
    assert len(blocks) >= 3, "the README and docs lost their Python examples"
    (tmp_path / "cases").symlink_to(ROOT / "cases")
    (tmp_path / "myring.py").write_text(my_ring_example())
    blocks.append(
        (
            "README.md (the adapter example, run)",
            "from harness import assert_ring_close, "
            "make_case\n"
            "import myring\nassert_ring_close(myring.my_ring, make_case(world_size=2, "
            "total_len=8, "
            "mask={'kind': 'causal'}, dtype='bf16'))\n",
        )
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    for i, (name, block) in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        p = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
        assert p.returncode == 0, (
            f"{name} Python block {i}:\n{block}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )


def test_documented_case_file_example_is_a_valid_case_and_the_faults_valid_faults():
    from harness import case as case_mod
    from harness.faults.schema import parse_faults

    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", ALL, re.S) if b.startswith("format:")]
    assert len(blocks) == 1, "docs/cases.md lost its case-file example"
    faults = [b for b in re.findall(r"```yaml\n(.*?)```", ALL, re.S) if b.startswith("faults:")]
    assert len(faults) == 1, "docs/faults.md lost its fault list"
    import yaml

    assert len(parse_faults(tuple(yaml.safe_load(faults[0])["faults"]), 4)) == 7
    case, _ = case_mod.loads(blocks[0], "docs/cases.md")
    assert case.world_size == 4 and case.layout == "zigzag"
