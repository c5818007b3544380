"""Output paths refused before any rank starts, and results never lost (#51, harness.outputs)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from harness import outputs
from harness.checks import check as check_mod
from harness.checks import report
from harness.checks.options import CheckOptions
from harness.commands import cli
from harness.errors import HarnessError
from harness.ranks.pool import RankPool

ROOT = Path(__file__).resolve().parents[1]


class ReachedRanks(BaseException):
    """Starting a pool: the input was not refused first."""


def _no_ranks(*_args, **_kwargs):
    raise ReachedRanks()


def test_an_unwritable_file_or_directory_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    for bad, check, why in [
        ("/proc/x.json", outputs.check_file, "cannot create a file in /proc"),
        (str(tmp_path), outputs.check_file, "is a directory"),
        (str(tmp_path / "f" / "x.json"), outputs.check_file, "is not a directory"),
        (str(tmp_path / "f"), outputs.check_dir, "exists and is not a directory"),
        ("/proc/new/dir", outputs.check_dir, "cannot create a file in /proc"),
        ("", outputs.check_dir, "an empty path"),
    ]:
        with pytest.raises(HarnessError, match=why) as e:
            check(bad, "--out")
        assert str(e.value).startswith(f"--out {bad}: ") and "\n" not in str(e.value)


def test_writable_paths_pass_and_nothing_is_created(tmp_path):
    outputs.check_file(tmp_path / "a" / "b" / "r.json", "--json")
    outputs.check_dir(tmp_path / "new" / "dir", "--save-dir")
    outputs.check_file("/dev/null", "--json")
    outputs.check_file(None, "--json")
    assert list(tmp_path.iterdir()) == []  # no directory made, no probe left


def test_a_path_that_fails_at_the_end_goes_to_a_printed_fallback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(outputs.FALLBACK_ENV, str(tmp_path / "fallback"))
    (tmp_path / "f").write_text("x")
    got = report.write_json(tmp_path / "f" / "r.json", {"verdict": "pass"})
    err = capsys.readouterr().err
    assert got.parent == tmp_path / "fallback" and json.loads(got.read_text()) == {
        "verdict": "pass"
    }
    assert f"could not write --json {tmp_path / 'f' / 'r.json'}" in err and str(got) in err


def test_when_the_fallback_fails_too_the_text_goes_to_stderr(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv(outputs.FALLBACK_ENV, str(tmp_path / "f"))
    outputs.write(tmp_path / "f" / "r.json", '{"verdict": "pass"}', "--json")
    assert capsys.readouterr().err.rstrip().endswith('{"verdict": "pass"}')


def test_a_device_is_written_in_place(tmp_path):
    assert outputs.write("/dev/null", "x", "--json") == Path("/dev/null")
    assert Path("/dev/null").is_char_device()


def test_a_check_whose_json_path_vanished_keeps_its_verdict(tmp_path, monkeypatch, capsys):
    """The JSON's directory becomes a file mid-run: the verdict lands in the printed fallback."""
    out_dir, fallback = tmp_path / "out", tmp_path / "fallback"
    out_dir.mkdir()
    monkeypatch.setenv(outputs.FALLBACK_ENV, str(fallback))
    monkeypatch.setattr(check_mod, "STAGES", ())  # the preflight case alone: one case
    monkeypatch.setattr(check_mod, "pool_size", lambda opts, caps: 2)
    real = check_mod.Check.preflight

    def vanish(self):
        r = real(self)
        shutil.rmtree(out_dir)
        out_dir.write_text("a file now")
        return r

    monkeypatch.setattr(check_mod.Check, "preflight", vanish)
    res = check_mod.check(CheckOptions(json=str(out_dir / "r.json"), world_size=2, max_examples=0))
    saved = list(fallback.iterdir())
    assert res.passed and len(saved) == 1
    assert json.loads(saved[0].read_text())["passed"] is True
    assert str(saved[0]) in capsys.readouterr().err


BAD = {
    "deep.yaml": "world_size: 1\nseq_lens: [2]\nmask: " + "{not: " * 3000 + "{}" + "}" * 3000,
    "big.yaml": "world_size: 1\nseq_lens: [1]\nhead_dim: 100000000\n",
}


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--json", "/proc/x.json"],
        ["check", "--save-dir", "/proc/ring-harness-failures"],
        ["check", "--plot", "/etc/passwd"],
        ["selftest", "--corpus", "/proc/c"],
        ["profile", "--trace", "/proc/t"],
        ["replay", "deep.yaml"],
        ["replay", "big.yaml"],
        ["check", "--shape", "b1,hq8,d100000000,L64,W2"],
    ],
)
def test_the_reproductions_of_51_are_one_line_before_any_rank(argv, tmp_path, monkeypatch):
    for name, text in BAD.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(RankPool, "__init__", _no_ranks)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ring-harness: error:"), lines
