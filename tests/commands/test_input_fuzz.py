"""The whole input surface, fuzzed (#51): case files and argument lists end in exit 0, 1 or 2.

Hypothesis mutates valid case files (fields dropped, renamed, retyped, numbers at and past their
extremes, deep nesting, aliases, non-UTF-8 bytes, huge files, YAML tags). It also draws argument
lists for check, replay, selftest and profile from their own parsers. Each runs through the
command line's `main`, in this process. None may raise, print a traceback or take long. Exit 2
is one `ring-harness: error:` line. Exit 1 only comes from a ring that ran and was wrong.

A valid input "reaches the ranks": starting a pool raises `ReachedRanks` instead. A small valid
case file runs for real on this module's pool, and the reference must pass it. The draws are
derandomised: the same examples on every machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness import case as case_mod
from harness.checks import replay as replay_mod
from harness.commands import cli
from harness.errors import HarnessError
from harness.ranks.pool import RankPool

POOL_SIZE = 2
SECONDS = 30  # the longest any one example may take, a real replay included
EXTREME_INTS = [
    0,
    -1,
    1,
    2,
    63,
    64,
    65,
    4096,
    4097,
    2**30,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1e4, 1.5e4, 1e308, math.inf, -math.inf, math.nan]
BASE = {
    "format": 1,
    "impl": "reference",
    "world_size": 2,
    "group_offset": 0,
    "batch": 1,
    "heads_q": 2,
    "heads_kv": 1,
    "head_dim": 8,
    "seq_lens": [3, 4],
    "layout": "zigzag",
    "mask": {"kind": "causal"},
    "dtype": "bf16",
    "softmax_scale": None,
    "values": "normal",
    "seed": 7,
    "faults": [],
    "tolerance": {},
    "deadline_s": 20,
}
BASES = [
    BASE,
    {**BASE, "mask": {"and": [{"kind": "causal"}, {"kind": "chunked", "size": 2}]}},
    {**BASE, "heads_q": 4, "heads_kv": 2, "head_dim": 4, "impl": "mutant:gqa-repeat"},
    {**BASE, "faults": [{"kind": "early-read"}], "dtype": "fp16"},
    {**BASE, "seq_lens": None, "total_len": 5, "dtype": "fp32", "call": "no-grad"},
    {**BASE, "sinks": [0.0, 2.5], "softcap": 5.0, "alibi": True, "head_dim_v": 4},
    {"format": 1, "sequence": [dict(BASE, leak_check=False), dict(BASE, seed=8)]},
]


class ReachedRanks(BaseException):
    """A valid input got as far as starting ranks. Nothing in the harness catches it."""


def _refuse_ranks(*_args, **_kwargs):
    raise ReachedRanks()


weird = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREME_INTS),
    st.sampled_from(EXTREME_FLOATS),
    st.text(max_size=6),
    st.lists(st.sampled_from(EXTREME_INTS), max_size=3),
    st.dictionaries(st.sampled_from(["kind", "x", "out", "rank"]), st.integers(), max_size=2),
)


@st.composite
def mutated(draw) -> dict:
    """A valid case mapping with one to three mutations."""
    d = copy.deepcopy(draw(st.sampled_from(BASES)))
    d = {k: v for k, v in d.items() if v is not None or k == "softmax_scale"}
    target = d["sequence"][-1] if "sequence" in d else d
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(target)))
        how = draw(st.sampled_from(["drop", "rename", "set", "nest", "fault", "mask", "list"]))
        if how == "drop":
            target.pop(key, None)
        elif how == "rename":
            target[draw(st.sampled_from([key + "s", key[:-1], key.upper()]))] = target.pop(key, 0)
        elif how == "set":
            target[key] = draw(weird)
        elif how == "nest":
            inner: object = {"kind": "causal"}
            for _ in range(draw(st.sampled_from([3, 9, 41]))):
                inner = {"not": inner}
            target["mask"] = inner
        elif how == "fault":
            kind = draw(st.sampled_from(["delay", "drop", "corrupt", "crash", "nope", None]))
            target["faults"] = [
                {"kind": kind, draw(st.sampled_from(["rank", "index"])): draw(weird)}
            ]
        elif how == "mask":
            kind = draw(st.sampled_from(["window", "document", "chunked", "prefix", "blocks"]))
            field = {"window": "window", "document": "doc_starts"}.get(kind, "size")
            target["mask"] = {"kind": kind, field: draw(weird)}
        else:
            target["seq_lens"] = [draw(weird), 3]
    return d


@st.composite
def case_texts(draw) -> bytes:
    """A case file's bytes: a mutated mapping dumped, then perhaps damaged as text."""
    text = yaml.safe_dump(draw(mutated()), sort_keys=False)
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "bytes", "huge", "bomb", "tag", "deep"]))
    if damage == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == "huge":
        text = "#" * (1 << 20) + "\n" + text
    elif damage == "bomb":
        text += "bomb: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
            f"b{i}: &b{i} [{', '.join(['*' + ('a' if i == 0 else f'b{i - 1}')] * 10)}]\n"
            for i in range(8)
        )
    elif damage == "tag":
        text = text.replace("impl:", "impl: !!python/object/apply:os.getcwd []\nx:", 1)
    elif damage == "deep":  # #51: a mask that nests `not` 3,000 deep, and a list 5,000 deep
        text += "mask: " + "{not: " * 3000 + "{kind: causal}" + "}" * 3000 + "\n"
        text += "note: " + "[" * 5000 + "]" * 5000 + "\n"
    data = text.encode()
    if damage == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + b"\xff\xfe\x00" + data[at:]
    return data


def _main(argv: list[str]) -> tuple[int | str, str, str, float]:
    """`ring-harness ARGV` in this process: (exit status or 'ranks', stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | str = cli.main(argv)
        except ReachedRanks:
            code = "ranks"
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - t0


def _assert_clean(code, out: str, err: str, seconds: float, what: str) -> None:
    """No traceback, a known exit, one error line for exit 2, and in time."""
    assert "Traceback" not in out + err, f"{what}: a traceback\n{err[-2000:]}"
    assert code in (0, 1, 2, "ranks"), f"{what}: exit {code}\n{err[-2000:]}"
    if code == 2:
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert last.startswith(("ring-harness: error:", "ring-harness: ")) or "error:" in last, (
            f"{what}: exit 2 without an error line: {err[-500:]!r}"
        )
    assert seconds < SECONDS, f"{what}: took {seconds:.1f} s"


def _too_big(case) -> bool:
    """Past any machine this runs on: the inputs alone, in float32, above 1 TiB."""
    return 16 * case.batch * case.heads_q * case.head_dim * case.total_len > 1 << 40


def _small(case) -> bool:
    """A case cheap enough to run here for real: no fault that waits out a deadline."""
    kinds = {f.get("kind") for f in case.faults}
    return (
        case.pool_size <= POOL_SIZE
        and case.total_len <= 64
        and case.batch * case.heads_q * case.head_dim <= 256
        and case.deadline_s <= 20
        and kinds <= {"early-read", "send-reuse"}
    )


@settings(
    max_examples=90,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=case_texts())
def test_a_case_file_ends_in_0_1_or_2(pool, data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.yaml"
        path.write_bytes(data)
        try:
            case = case_mod.load(path)[0]
        except HarnessError:
            case = None
        real = case is not None and _small(case)

        @contextlib.contextmanager
        def on_this_pool(*_args, **_kwargs):
            if not real:
                raise ReachedRanks()
            yield pool

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(replay_mod, "open_pool", on_this_pool)
            code, out, err, seconds = _main(["replay", str(path)])
    event(f"exit {code}{' (ran)' if real else ''}")
    what = f"replay of {data[:300]!r}"
    _assert_clean(code, out, err, seconds, what)
    if case is None or _too_big(case):
        assert code == 2, f"{what}: the file does not load or fit, yet exit {code}"
    if code == 1:
        assert real and case.impl != "reference", f"{what}: exit 1 on the reference\n{out[-1500:]}"


# -- argument lists ----------------------------------------------------------------------------

PATHS = ["/proc/x.json", "/proc/d", "/etc/passwd", "/", "", "no/such/dir/out.json", "out.json"]
# output paths that cannot be written: one line and exit 2 before any rank starts (#51)
UNWRITABLE = {
    "--json": {"/proc/x.json", "/proc/d", "/", ""},
    **dict.fromkeys(
        ("--save-dir", "--plot", "--trace", "--corpus"),
        {"/proc/x.json", "/proc/d", "/etc/passwd", ""},
    ),
}
NUMBERS = ["0", "-1", "1", "3", "8", "65", "1e309", "nan", "inf", "-inf", "9" * 30, "x", ""]


def _flags(command: str) -> list[argparse.Action]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.dest != "help"]


def _value(draw, action: argparse.Action) -> list[str]:
    """A flag and, when it takes one, a value drawn for its type."""
    flag = draw(st.sampled_from(action.option_strings))
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, draw(st.sampled_from([*map(str, action.choices), "nope", ""]))]
    if action.type in (int, float):
        return [flag, draw(st.sampled_from(NUMBERS))]
    return [flag, draw(st.sampled_from([*PATHS, "reference", "mutant:nope", "no.such:ring"]))]


@st.composite
def argument_lists(draw) -> list[str]:
    command = draw(st.sampled_from(["check", "replay", "selftest", "profile"]))
    actions = _flags(command)
    argv = [command]
    if command == "replay":
        argv.append(draw(st.sampled_from(["cases/mutant-gqa-repeat.yaml", "nope.yaml", "/", ""])))
    for _ in range(draw(st.integers(0, 4))):
        argv += _value(draw, draw(st.sampled_from(actions)))
    if draw(st.booleans()):
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--nope", "-z", "x"])))
    return argv


@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(argv=argument_lists())
def test_an_argument_list_ends_in_2_or_reaches_the_ranks(argv: list[str]):
    """A bad option is one line and exit 2; a valid list gets as far as starting ranks."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.chdir(Path(__file__).resolve().parents[2])
        mp.setattr(RankPool, "__init__", _refuse_ranks)
        argv = [a.replace("out.json", f"{tmp}/out.json") for a in argv]
        code, out, err, seconds = _main(argv)
    event(f"{argv[0]} exit {code}")
    what = f"ring-harness {' '.join(argv)}"
    _assert_clean(code, out, err, seconds, what)
    assert code in (2, "ranks"), f"{what}: exit {code} without ranks"
    last = {flag: value for flag, value in zip(argv, argv[1:], strict=False) if flag in UNWRITABLE}
    if any(value in UNWRITABLE[flag] for flag, value in last.items()):
        assert code == 2, f"{what}: an output path that cannot be written reached the ranks"
