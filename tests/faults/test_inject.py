"""What fault kinds do to tensors and processes, in one process: bit flips, poison, delays, crash
notes; and the op log's written forms and readers (faults.oplog)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from harness.faults import inject, interpose, oplog
from harness.faults.schema import parse_fault


def _spec(**kw):
    return parse_fault(0, kw, 4)


def test_flip_bits_is_seeded_and_flips_exactly_one_bit_per_element():
    spec = _spec(kind="corrupt", rank=0, count=3)
    a = torch.randn(64)
    b = a.clone()
    flips_a = inject.flip_bits(a, inject.rng_for(5, spec, 1, 2), count=3)
    c = b.clone()
    flips_c = inject.flip_bits(c, inject.rng_for(5, spec, 1, 2), count=3)
    assert flips_a == flips_c and torch.equal(a.view(torch.int32), c.view(torch.int32))
    diff = a.view(torch.int32) ^ b.view(torch.int32)
    assert int((diff != 0).sum()) == 3
    assert all(bin(int(x) & 0xFFFFFFFF).count("1") == 1 for x in diff[diff != 0])
    other = b.clone()
    inject.flip_bits(other, inject.rng_for(6, spec, 1, 2), count=3)
    assert not torch.equal(other, a)  # another case seed picks other elements/bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_flip_of_a_chosen_bit(dtype):
    t = torch.zeros(4, dtype=dtype)
    inject.flip_bits(t, random.Random(0), bit=3, count=1)
    assert int((t.view(-1).view(torch.uint8) != 0).sum()) == 1
    assert inject.flip_bits(torch.zeros(0, dtype=dtype), random.Random(0)) == []


def test_poison_and_same_bits():
    f = torch.ones(3)
    inject.poison(f)
    assert torch.isnan(f).all()
    i = torch.zeros(3, dtype=torch.int32)
    inject.poison(i)
    assert (i == torch.iinfo(torch.int32).max).all()
    assert inject.same_bits(f, f.clone())  # NaN-safe, unlike ==
    g = f.clone()
    g[1] = 0
    assert not inject.same_bits(f, g)


def test_delay_jitter_is_seeded_and_bounded():
    spec = _spec(kind="delay", seconds=0.1, jitter=0.05)
    d1 = inject.delay_seconds(spec, inject.rng_for(1, spec, 0, 3))
    assert d1 == inject.delay_seconds(spec, inject.rng_for(1, spec, 0, 3))
    assert 0.1 <= d1 < 0.15
    assert inject.delay_seconds(_spec(kind="delay", seconds=0.2), random.Random(0)) == 0.2


@pytest.mark.parametrize("how, code", [("exit0", 0), ("exit1", 1), ("sigkill", -9)])
def test_crash_leaves_a_note_then_exits_the_scheduled_way(tmp_path, how, code, capsys):
    seen = []
    note = {"fault": 2, "op": "isend to peer rank 1 (forward, op #0)"}
    inject.crash(how, note, str(tmp_path / "crash-0"), exit_fn=seen.append)
    assert seen == [code]
    assert json.loads((tmp_path / "crash-0").read_text()) == note
    assert f"crash ({how}) at isend to peer rank 1" in capsys.readouterr().out


def _log():
    ops = [
        oplog.Op(0, "isend", "send", 1, 64, "forward", "done"),
        oplog.Op(1, "irecv", "recv", 2, 64, "forward"),
        oplog.Op(2, "isend", "send", 1, 64, "backward", "waiting"),
        oplog.Op(3, "all_reduce", "collective", None, 8, "backward"),
    ]
    return ops, oplog.compact_log(ops)


def test_op_log_compact_form_and_readers():
    ops, log = _log()
    assert log[0] == ["isend", 1, 64, "forward", "done"]
    assert oplog.phase_counts(log) == {
        "forward": {"isend": 1, "irecv": 1},
        "backward": {"isend": 1, "all_reduce": 1},
    }
    assert interpose.phase_counts is oplog.phase_counts  # still importable from where it was
    comm = {0: log, 1: log[1:]}
    assert oplog.comm_steps(comm) == {0: 1, 1: 0}
    assert oplog.comm_steps(comm, "backward", ("isend", "all_reduce")) == {0: 2, 1: 2}


def test_pending_text_names_the_waited_op_first(tmp_path):
    ops, _ = _log()
    text = oplog.pending_text(3, ops[2], ops[1:])
    assert text.splitlines() == [
        "rank 3 last blocked waiting on isend to peer rank 1 (backward, op #2)",
        "  pending irecv from peer rank 2 (forward, op #1) [posted]",
        "  pending all_reduce (backward, op #3) [posted]",
    ]
    path = tmp_path / "pending-3"
    oplog.overwrite(str(path), text)
    oplog.overwrite(str(path), "short")  # in place, padded: readers strip
    assert path.read_text().strip() == "short"
