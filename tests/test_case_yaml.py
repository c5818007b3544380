"""A case file's YAML read within limits (#51, harness.case_yaml): each limit is one line."""

from __future__ import annotations

import time

import pytest
import yaml

from harness import case as case_mod
from harness import case_yaml
from harness.errors import HarnessError

CASE = "world_size: 2\nseq_lens: [3, 3]\n"


def _bomb(levels: int) -> str:
    text = "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
    for i in range(1, levels):
        text += f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n"
    return text


@pytest.mark.parametrize(
    "text, why",
    [
        (
            CASE + "mask: " + "{not: " * 3000 + "{kind: causal}" + "}" * 3000,
            "nested deeper than 40",
        ),
        (CASE + "note: " + "[" * 100 + "]" * 100, "nested deeper than 40"),
        (_bomb(6), "more than 50,000 nodes"),
        (CASE + "note: [" + ", ".join(["1"] * 60_000) + "]", "more than 50,000 nodes"),
        ("x: &x 1\n" + "".join(f"y{i}: *x\n" for i in range(10_001)), "more than 10000 aliases"),
        ("#" * (1 << 20) + "\n" + CASE, "larger than 1 MiB"),
        (CASE + "impl: !!python/object/apply:os.getcwd []\n", "malformed YAML"),
        ("world_size: [2\n", "line 2 malformed YAML"),
    ],
)
def test_each_limit_is_one_line(tmp_path, text, why):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    t0 = time.perf_counter()
    with pytest.raises(HarnessError, match=why) as e:
        case_mod.load(p)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(p))
    # a bomb is refused, not expanded: a fraction of a second alone, 7 s once under load; a bomb
    # expanded would take minutes and gigabytes
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: p.write_bytes(CASE.encode() + b"\xff\xfe"), "not a UTF-8 text file"),
        (lambda p: p.mkdir(), "a directory"),
        (lambda p: None, "No such file"),
    ],
)
def test_a_file_that_is_not_text_is_one_line(tmp_path, make, why):
    p = tmp_path / "c.yaml"
    make(p)
    with pytest.raises(HarnessError, match=why):
        case_mod.load(p)


def test_a_device_is_never_read_to_its_end():
    with pytest.raises(HarnessError, match="not a regular file"):
        case_yaml.read("/dev/zero")


def test_the_largest_file_the_harness_writes_reads_within_the_limits():
    """A 256-case sequence (MAX_SEQUENCE) with a recorded result, aliases as safe_dump writes."""
    member = {"world_size": 2, "seq_lens": [3, 3], "mask": {"kind": "causal"}, "leak_check": True}
    checks = [
        {"tensor": "out", "rank": r, "error": 0.1, "position": {"batch": 0}} for r in range(8)
    ]
    seq = [dict(member, seed=i) for i in range(case_mod.MAX_SEQUENCE)]
    seq[-1]["result"] = {"verdict": "silent-corruption", "checks": checks * 8}
    data = case_yaml.loads(yaml.safe_dump({"format": 1, "sequence": seq}))
    assert len(data["sequence"]) == case_mod.MAX_SEQUENCE
