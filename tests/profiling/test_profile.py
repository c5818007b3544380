"""`ring-harness profile`: each promise's verdict on rings whose answer is known.

The reference keeps every promise. Each profile mutant (ring_impl.mutants.profile) returns the
reference's numbers and breaks one promise, and the README's all-gather ring gathers K/V. The
memory fit over length is tested on synthetic peaks too. About 25-50 s on 2 cores.
"""

from __future__ import annotations

import json

import pytest

from harness.commands.cli import main
from harness.profiling import timeline
from harness.profiling.memory import UNKNOWN, LengthSweep, MemoryClass
from harness.profiling.overlap import PhaseOverlap
from harness.profiling.report import profile_ring
from harness.profiling.traffic import wire_bytes

POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py): W = 1, 2, 4
TOKENS = 32


def _profile(pool, impl: str, allow_import: bool = False):
    return profile_ring(impl, pool, tokens_per_rank=TOKENS, allow_import=allow_import)


def test_the_reference_keeps_every_promise(pool):
    p = _profile(pool, "reference")
    assert p.kept and p.broken() == []
    assert p.memory.verdict == "O(n/W)" and p.memory.held_copies < 0.1
    assert sorted(p.memory.peaks) == [1, 2, 4] and p.world_size == 4
    grown = p.memory.length  # W = 2 and 4 at 32, 64, 128 tokens a rank
    assert grown.verdict == "O(n/W)" and grown.held_copies < 0.1 and grown.tokens == [32, 64, 128]
    assert grown.growth > 1.0  # its own growth (score blocks): one W's slope cannot judge it
    fwd, bwd = p.traffic["forward"], p.traffic["backward"]
    assert fwd.ratio == pytest.approx(1.0) and bwd.ratio == pytest.approx(1.0)
    assert (fwd.messages, fwd.hops) == (3, 3) and fwd.rounds <= fwd.hops
    assert {o.verdict for o in p.overlap.values()} == {"overlapped"}
    assert p.overlap["forward"].hidden == p.overlap["forward"].receives == 12
    # causal work: the contiguous layout loads the last rank, zigzag and striped even it out
    assert p.balance["contiguous"] > 1.4 and p.balance["zigzag"] == pytest.approx(1.0, abs=0.05)
    # the timeline: a valid trace-event file, a track per rank, and its Gantt chart
    data = timeline.trace(p.call)
    assert timeline.valid(data) == []
    assert {"compute", "wait", "post"} <= {e.get("cat") for e in data["traceEvents"]}
    assert {e["pid"] for e in data["traceEvents"]} == {0, 1, 2, 3}
    assert timeline.valid({"traceEvents": [{"ph": "X", "name": "a"}]})  # the validator bites


def test_a_ring_that_waits_before_computing_is_named(pool):
    p = _profile(pool, "mutant:wait-before-compute")
    assert not p.kept and p.memory.kept
    assert {o.verdict for o in p.overlap.values()} == {"waits before computing"}
    assert all(t.ratio == pytest.approx(1.0) for t in p.traffic.values())


def test_k_and_v_in_separate_unbatched_hops_are_named(pool):
    p = _profile(pool, "mutant:split-unbatched-hops")
    fwd = p.traffic["forward"]
    assert (fwd.messages, fwd.rounds, fwd.hops) == (6, 6, 3) and not fwd.kept
    assert fwd.ratio == pytest.approx(1.0)  # the same bytes, twice the messages
    assert "2.0 a hop" in fwd.line() and not p.kept


def test_rings_that_gather_k_and_v_are_o_of_n(pool):
    p = _profile(pool, "mutant:all-gather-kv")
    assert p.memory.verdict == "O(n): gathers K/V" and p.memory.held_copies >= 1.0
    assert p.memory.length.verdict == "O(n): gathers K/V" and p.memory.length.held_copies >= 1.0
    assert p.broken()[:2] == ["memory O(n): gathers K/V", "memory over length O(n): gathers K/V"]
    assert p.overlap["forward"].verdict == "waits before computing" and not p.kept
    # the README's own example ring: tests/commands/test_readme_commands.py::_readme_ring_is_o_of_n


def test_verdict_rules_without_ranks():
    assert PhaseOverlap("forward").verdict == "no communication"
    assert PhaseOverlap("forward", receives=4, hidden=1).verdict == "partly overlapped"
    assert PhaseOverlap("forward", receives=4, hidden=2).verdict == "overlapped"
    # a ring algorithm's bytes for a collective whose input is 100 bytes, W = 4
    assert [wire_bytes(k, 100, 4) for k in ("all_gather", "reduce_scatter", "all_reduce")] == [
        300,
        75,
        150,
    ]
    # a scatter's root logs its whole list and keeps its own share; the other ranks log none
    assert (wire_bytes("scatter", 100, 4), wire_bytes("scatter", 0, 4)) == (75, 0)


def test_the_length_fit_without_ranks():
    """Synthetic peaks at W = 4 and 8: the part of the growth that grows with n is judged."""
    kv, tokens = 512, [64, 128, 256]

    def own(m: int, w: int) -> int:  # inputs, gradients, blocks, (n/W)^2 scores, a W constant
        return 200_000 + 30 * kv * m + 6 * m * m + 1000 * w

    def sweep(extra) -> LengthSweep:
        return LengthSweep(
            tokens, {w: [own(m, w) + extra(m, w) for m in tokens] for w in (4, 8)}, {4: kv, 8: kv}
        )

    ring = sweep(lambda m, w: 0)
    assert ring.held_copies == pytest.approx(0.0) and ring.verdict == "O(n/W)"
    assert ring.growth > 4  # one W's slope would call the ring O(n)
    gather = sweep(lambda m, w: w * m * kv)  # a K/V copy of every global token
    assert gather.held_copies == pytest.approx(1.0) and gather.verdict == "O(n): gathers K/V"
    assert gather.growth == pytest.approx(ring.growth + 1.0)
    assert "1.00 with n" in gather.line() and "W8 " in gather.line()
    # one more block of its own K/V at the larger W: 1 / (8 - 4) copies, still O(n/W)
    block = sweep(lambda m, w: (w == 8) * m * kv)
    assert block.held_copies == pytest.approx(0.25) and block.verdict == "O(n/W)"
    # edges: one ring size or one length is unknown; the length sweep alone breaks the promise
    assert LengthSweep(tokens, {4: [1, 2, 3]}, {4: kv}).verdict == UNKNOWN
    assert LengthSweep(tokens[:1], {4: [1], 8: [1]}, {4: kv, 8: kv}).held_copies is None
    flat = MemoryClass(64, {4: 100_000, 8: 100_000}, {4: kv, 8: kv}, length=gather)
    assert flat.verdict == "O(n/W)" and not flat.kept
    assert flat.broken() == ["memory over length O(n): gathers K/V"]


def test_the_command_exits_1_naming_the_ring_that_breaks_a_promise(capsys, tmp_path):
    """The command end to end at W <= 2: the table, the straggler line, the trace files, exit 1."""
    argv = ["profile", "--max-world-size", "2", "--tokens-per-rank", "16", "--straggler", "3"]
    argv += ["--impl", "reference", "--impl", "mutant:wait-before-compute"]
    code = main([*argv, "--trace", str(tmp_path), "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert code == 1 and "mutant:wait-before-compute break(s) a promise" in out
    assert "straggler at W2 (reported, not judged; noisy below ~100 ms): one rank x3" in out
    assert (tmp_path / "reference.trace.json").exists()
    assert "over length" in out  # the table's column; W <= 2 runs no length sweep: "-"
    rings = json.loads((tmp_path / "p.json").read_text())["rings"]
    assert [r["kept"] for r in rings] == [True, False]
    assert main(["profile", "--tokens-per-rank", "0"]) == 2
