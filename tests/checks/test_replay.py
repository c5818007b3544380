"""`ring-harness replay`: reproduces a recorded verdict bit for bit, notices changed hashes, passes
the same case on the reference, and answers bad input with exit 2 and one line."""

from __future__ import annotations

import contextlib

import pytest
import yaml

from harness import case as case_mod
from harness.case import make_case
from harness.commands.cli import main
from harness.runner import run_case
from harness.search.failures import save_failure

PLANTED = "tests.helpers.planted_impls:late_diagonal"


POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


@pytest.fixture
def shared_pool(pool, monkeypatch):
    """The replay command opens its own pool; here it gets the module's (no start-up per call)."""
    import harness.checks.replay as cmd

    @contextlib.contextmanager
    def reuse(launcher, backend, size, placement=None):
        assert size <= pool.size
        yield pool

    monkeypatch.setattr(cmd, "open_pool", reuse)
    return pool


@pytest.fixture
def planted_file(pool, tmp_path):
    c = make_case(
        world_size=3,
        seq_lens=(1, 1, 1),
        mask={"kind": "causal"},
        heads_q=1,
        heads_kv=1,
        head_dim=4,
        impl=PLANTED,
    )
    r = run_case(c, pool, allow_import=True)
    assert r.verdict == "silent-corruption"
    return save_failure(r, tmp_path / "late-diagonal.yaml", "planted late diagonal")


def test_reproduces_verdict_and_hashes(shared_pool, planted_file, capsys, tmp_path):
    assert (
        main(["replay", str(planted_file), "--impl", PLANTED, "--json", str(tmp_path / "r.json")])
        == 1
    )
    out = capsys.readouterr().out
    assert "silent-corruption: reproduces the recorded verdict" in out
    assert "all 15 output shards match the record bit for bit" in out
    assert "mask hides" not in out  # block-level probes only with --plot
    assert "fails only on rank(s)" in out


def test_a_changed_hash_is_reported(shared_pool, planted_file, capsys):
    data = yaml.safe_load(planted_file.read_text())
    data["result"]["hashes"][1]["dk"] = "0" * 16
    planted_file.write_text(yaml.safe_dump(data))
    assert main(["replay", str(planted_file), "--impl", PLANTED]) == 1
    out = capsys.readouterr().out
    assert "1 of 15 output shards DIFFER" in out and "dk@rank1" in out


def test_a_recorded_pass_that_now_fails_does_not_reproduce(shared_pool, planted_file, capsys):
    data = yaml.safe_load(planted_file.read_text())
    data["result"]["verdict"] = "pass"
    planted_file.write_text(yaml.safe_dump(data))
    assert main(["replay", str(planted_file), "--impl", PLANTED]) == 1
    assert "does NOT reproduce the recorded verdict pass" in capsys.readouterr().out


def test_same_case_passes_on_the_reference(shared_pool, planted_file, capsys, tmp_path):
    assert (
        main(
            ["replay", str(planted_file), "--impl", "reference", "--plot", str(tmp_path / "plots")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "verdict: pass" in out and "recorded for tests.helpers.planted_impls:late_diagonal" in out
    )
    assert not (tmp_path / "plots").exists()  # nothing to plot for a pass


def test_plot_of_a_failing_replay(shared_pool, planted_file, capsys, tmp_path):
    assert (
        main(["replay", str(planted_file), "--impl", PLANTED, "--plot", str(tmp_path / "plots")])
        == 1
    )
    out = capsys.readouterr().out
    assert "mask hides" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        f"late-diagonal-{t}.png" for t in ("dk", "dq", "dv", "out")
    ]


def test_a_passing_reference_case_replays_with_exit_0(shared_pool, pool, tmp_path, capsys):
    c = make_case(
        world_size=2, seq_lens=(3, 2), layout="zigzag", mask={"kind": "window", "window": 2}
    )
    r = run_case(c, pool)
    from harness.result import result_record

    path = case_mod.save(c, tmp_path / "ok.yaml", result=result_record(r))
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pass: reproduces the recorded verdict" in out and "bit for bit" in out


@pytest.mark.parametrize(
    "text, needle",
    [
        (None, "cannot read case file"),
        ("world_size: [1\n", "malformed YAML"),
        ("world_size: 2\nseq_lens: [1]\n", "'seq_lens'"),
        (f"world_size: 1\nseq_lens: [2]\nimpl: {PLANTED}\n", "give it on the command line"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_hashes_must_match_only_on_the_torch_and_cpu_platform_they_were_recorded_on():
    """MKL and ATen pick kernels by the CPU: the corpus recorded on one machine rounded
    differently on an Intel AVX512 one (5 mutant cases, fp32 among them; MKL_CBWR=COMPATIBLE made
    them match)."""
    import torch

    from harness.checks.replay import hash_note
    from harness.result import cpu_platform

    here = {"torch": str(torch.__version__), "platform": cpu_platform()}
    assert hash_note(here) == ""
    assert "information only" in hash_note({**here, "platform": "x86_64 AuthenticAMD AVX2"})
    assert "not recorded" in hash_note({"torch": here["torch"]})
    assert "information only" in hash_note({**here, "torch": "0.0"})
    assert cpu_platform().count(" ") >= 2  # architecture, vendor, torch's CPU capability


def test_a_fail_stop_of_another_exception_class_does_not_reproduce():
    """A recorded RuntimeError replayed as an import's IndexError is not the bug again (#44:
    yunchang 0.6.3.post1 without TORCH_CUDA_ARCH_LIST). Messages may differ; the class may not."""
    from harness.case import make_case
    from harness.checks.replay import Replay, error_classes
    from harness.result import CaseResult, Verdict

    recorded = {0: "RuntimeError: expected 14, got 13 (at graph.py:979)", 1: "RuntimeError: x"}
    assert error_classes(recorded) == {"RuntimeError"}

    def replay(errors: dict) -> Replay:
        r = CaseResult(case=make_case(), impl="x", verdict=Verdict.FAIL_STOP, errors=errors)
        return Replay(result=r, recorded_verdict="fail-stop", recorded_errors=recorded)

    assert replay({0: "RuntimeError: other words", 1: "died (signal 6)"}).verdict_reproduced
    assert not replay(
        {0: "IndexError: list index out of range (at cpp_extension.py)"}
    ).verdict_reproduced
    assert replay({0: "died (signal 6)"}).verdict_reproduced  # no class to compare
