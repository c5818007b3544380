"""Case YAML: round trip, schema validation with one clear message, no code execution."""

from __future__ import annotations

import pytest

from harness import case as case_mod
from harness.case import Case, make_case
from harness.errors import HarnessError
from ring_impl.masks import MaskSpec


def test_round_trip_every_field(tmp_path):
    c = make_case(
        world_size=3,
        seq_lens=(5, 1, 17),
        layout="zigzag",
        heads_q=4,
        heads_kv=2,
        head_dim=12,
        mask={"kind": "document", "doc_starts": [0, 4, 9], "causal": False},
        dtype="bf16",
        softmax_scale=0.25,
        values="large",
        seed=99,
        group_offset=1,
        tolerance={"dq": 4.0},
        deadline_s=12.5,
        faults=({"kind": "delay", "rank": 1},),
    )
    path = case_mod.save(c, tmp_path / "c.yaml", result={"verdict": "pass"}, note="a note")
    loaded, data = case_mod.load(path)
    assert loaded == c
    assert data["result"] == {"verdict": "pass"}
    assert path.read_text().startswith("# a note\n")


def test_total_len_resolves_to_even_split():
    c, _ = case_mod.loads("world_size: 4\ntotal_len: 10\nmask: {kind: causal}\n")
    assert c.seq_lens == (3, 3, 2, 2)
    assert c.mask == MaskSpec("causal")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("world_size: 2\nseq_lens: [3, 3]\nheads_q: 3\nheads_kv: 2\n", "'heads_kv'"),
        ("world_size: 2\nseq_lens: [3]\n", "'seq_lens'"),
        ("world_size: 2\nseq_lens: [0, 0]\n", "at least 1"),
        ("world_size: 2\nseq_lens: [3, -1]\n", "'seq_lens'"),
        ("world_size: 2\nseq_lens: [3, 3]\nlayout: spiral\n", "unknown layout 'spiral'"),
        ("world_size: 2\nseq_lens: [3, 3]\ndtype: fp8\n", "unknown dtype 'fp8'"),
        ("world_size: 2\nseq_lens: [3, 3]\nmask: {kind: window}\n", "window must be an integer"),
        (
            "world_size: 2\nseq_lens: [3, 3]\nmask: {kind: document, doc_starts: [0, 9]}\n",
            "beyond the sequence",
        ),
        (
            "world_size: 2\nseq_lens: [3, 3]\nmask: {kind: document, doc_starts: [1, 3]}\n",
            "beginning with 0",
        ),
        ("world_size: 2\nseq_lens: [3, 3]\ncolour: red\n", "unknown case field(s): colour"),
        ("world_size: two\nseq_lens: [3, 3]\n", "'world_size'"),
        ("world_size: 2\nseq_lens: [3, 3]\ntolerance: {out: -1}\n", "'tolerance'"),
        ("world_size: 2\nseq_lens: [3, 3]\nsoftmax_scale: .nan\n", "'softmax_scale'"),
        ("world_size: 2\nseq_lens: [3, 3]\ndeadline_s: 0\n", "'deadline_s'"),
        ("world_size: 2\nseq_lens: [3, 3]\nformat: 7\n", "unsupported case format"),
        ("world_size: 2\ntotal_len: 6\nseq_lens: [3, 3]\n", "exclusive"),
        ("- just\n- a list\n", "must be a mapping"),
        ("", "empty case file"),
        ("world_size: [1, 2\n", "malformed YAML"),
    ],
)
def test_bad_case_gets_one_clear_line(text, needle):
    with pytest.raises(HarnessError) as e:
        case_mod.loads(text, "bad.yaml")
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg and msg.startswith("bad.yaml")


def test_yaml_tags_never_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    text = f"world_size: !!python/object/apply:os.system ['touch {marker}']\nseq_lens: [1]\n"
    with pytest.raises(HarnessError, match="malformed YAML"):
        case_mod.loads(text)
    assert not marker.exists()


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(HarnessError, match="cannot read case file"):
        case_mod.load(tmp_path / "nope.yaml")


def test_atomic_save_leaves_no_temp_files(tmp_path):
    c = Case(world_size=1, seq_lens=(4,))
    for _ in range(3):
        case_mod.save(c, tmp_path / "x.yaml")
    assert [p.name for p in tmp_path.iterdir()] == ["x.yaml"]


def test_key_is_stable_and_sensitive():
    a = Case(world_size=1, seq_lens=(4,), seed=1)
    assert a.key() == Case(world_size=1, seq_lens=(4,), seed=1).key()
    assert a.key() != a.replace(seed=2).key()


def test_summary_states_the_total_and_the_per_rank_lengths():
    """`L[1]` at W2 read as one token in total (issue #18): the summary says the total, then per
    rank."""
    from harness.case import make_case

    assert make_case(world_size=2, total_len=2).summary().endswith(" L2=1/rank")
    assert make_case(world_size=4, total_len=27).summary().endswith(" L27=7,7,7,6")
    assert " L5=5/rank" in make_case(world_size=1, total_len=5, values="near-tie").summary()
