"""Case: everything one run depends on, and its YAML form.

Tensors are never stored: every rank rebuilds its shard of q, k, v and dout from the seed. A case
file is read with safe_load and checked against a schema. It holds one case, or a sequence of them
under a top-level `sequence:` list. For a sequence file, `load` gives the last member. The sequence
as a type lives in `harness.case_sequence`. What each field may hold is in `harness.case_schema`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import case_yaml, limits, outputs, serving_case
from harness.case_schema import mask_from_dict, validate
from harness.errors import HarnessError
from ring_impl.layouts import split_lengths
from ring_impl.masks import MaskSpec
from ring_impl.serving import Requests

FORMAT = 1


@dataclass(frozen=True)
class Case:
    """One run: shapes, split, layout, mask, dtype, seed, implementation, faults, tolerances."""

    world_size: int = 4
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 16
    seq_lens: tuple[int, ...] = (8, 8, 8, 8)
    layout: str = "contiguous"
    mask: MaskSpec = field(default_factory=MaskSpec)
    dtype: str = "fp32"
    softmax_scale: float | None = None
    values: str = "normal"
    seed: int = 0
    impl: str = "reference"
    group_offset: int = 0
    faults: tuple[dict, ...] = ()
    tolerance: dict = field(default_factory=dict)
    deadline_s: float = 60.0
    call: str = "train"  # how the model calls the ring: harness.calls.CALLS
    inputs: str = "contiguous"  # the form q, k, v and dout come in: harness.calls.INPUT_FORMS
    # the attention variants (docs/case-model.md); each default is plain attention
    head_dim_v: int | None = None  # v's, out's and dout's head dim; None: head_dim
    softcap: float | None = None  # scores become cap * tanh(s / cap)
    alibi: bool = False  # ALiBi: -slope_h * |p_i - p_j| from global positions
    sinks: tuple[float, ...] | None = None  # one learnable logit per query head
    # an inference shape (harness.serving_case): requests with cached and new tokens; None: training
    serving: Requests | None = None

    def __post_init__(self) -> None:
        validate(self)

    # -- derived ----------------------------------------------------------------------------
    @property
    def total_len(self) -> int:
        return sum(self.seq_lens)

    @property
    def pool_size(self) -> int:
        """Ranks the pool needs. The ring group is global ranks [offset, offset + world_size)."""
        return self.group_offset + self.world_size

    @property
    def dim_v(self) -> int:
        """v's head dim: head_dim_v, else head_dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def variants(self) -> tuple[str, ...]:
        """The attention variants this case uses, by their capability names."""
        on = {
            "sinks": self.sinks is not None,
            "softcap": self.softcap is not None,
            "alibi": self.alibi,
            "head_dim_v": self.head_dim_v is not None,
        }
        return tuple(name for name, used in on.items() if used)

    @property
    def shape(self) -> str:
        """The attention's shape: train, prefill (onto a cache) or decode."""
        return serving_case.shape_of(self.serving)

    @property
    def scale(self) -> float:
        return (
            self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )

    def summary(self) -> str:
        """A short one-line description for tables."""
        heads = (
            f"h{self.heads_q}"
            if self.heads_q == self.heads_kv
            else f"h{self.heads_q}/{self.heads_kv}"
        )
        mask = self.mask.describe()
        # the total, then the per-rank lengths: `L16=4/rank` (even split), `L27=7,7,7,6` (one per
        # rank)
        per = (
            f"{self.seq_lens[0]}/rank"
            if len(set(self.seq_lens)) == 1
            else ",".join(map(str, self.seq_lens))
        )
        lens = f"{self.total_len}={per}"
        extra = f" vals={self.values}" if self.values != "normal" else ""
        extra += f" off{self.group_offset}" if self.group_offset else ""
        extra += f" scale={self.softmax_scale:g}" if self.softmax_scale is not None else ""
        extra += f" faults={len(self.faults)}" if self.faults else ""
        extra += f" call={self.call}" if self.call != "train" else ""
        extra += f" inputs={self.inputs}" if self.inputs != "contiguous" else ""
        extra += f" dv{self.head_dim_v}" if self.head_dim_v is not None else ""
        extra += f" cap{self.softcap:g}" if self.softcap is not None else ""
        extra += " alibi" if self.alibi else ""
        extra += f" sinks={_sinks_words(self.sinks)}" if self.sinks is not None else ""
        extra += f" {serving_case.describe(self.serving)}" if self.serving is not None else ""
        # a serving case's KV distribution is in its serving words; its shape stands for the layout
        layout = self.layout if self.serving is None else self.shape
        return (
            f"W{self.world_size} {layout} {mask} {self.dtype} b{self.batch} {heads} "
            f"d{self.head_dim} "
            f"L{lens}{extra}"
        )

    def key(self) -> str:
        """A stable short hash of the case (used in file names)."""
        blob = json.dumps(to_dict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)


def _sinks_words(sinks: tuple[float, ...]) -> str:
    """'0' when every sink is zero, else the range of their values, e.g. '2.1..5.3'."""
    lo, hi = min(sinks), max(sinks)
    return f"{lo:g}" if lo == hi else f"{lo:.2g}..{hi:.2g}"


def make_case(total_len: int | None = None, **fields: Any) -> Case:
    """A Case, its `seq_lens` split evenly from `total_len` when per-rank lengths are not given."""
    if total_len is not None:
        if "seq_lens" in fields:
            raise HarnessError("give either total_len or seq_lens, not both")
        fields["seq_lens"] = tuple(split_lengths(int(total_len), int(fields.get("world_size", 4))))
    if isinstance(fields.get("mask"), dict):
        fields["mask"] = mask_from_dict(fields["mask"])
    if "seq_lens" in fields:
        fields["seq_lens"] = tuple(fields["seq_lens"])
    if fields.get("sinks") is not None:
        fields["sinks"] = tuple(fields["sinks"])
    _derive_serving(fields)
    return Case(**fields)


def _derive_serving(fields: dict) -> None:
    """A serving mapping read into `Requests`, and its ranks' KV lengths as `seq_lens` when absent."""
    req = fields.get("serving")
    if req is not None and not isinstance(req, Requests):
        req = fields["serving"] = serving_case.from_dict(req)
    if isinstance(req, Requests) and "seq_lens" not in fields:
        try:
            fields["seq_lens"] = serving_case.seq_lens(req, int(fields.get("world_size", 4)))
        except (ValueError, TypeError) as e:
            raise HarnessError(f"case field 'serving': {e}") from None


# -- dict / YAML -----------------------------------------------------------------------------

CASE_KEYS = {f.name for f in dataclasses.fields(Case)}
# impl_version: the library release a case needs (a bug at the version it shipped in,
# ci/historical). The suite skips the case under any other release.
FILE_KEYS = CASE_KEYS | {"format", "total_len", "result", "note", "expect", "impl_version"}
# What replaying a saved case must give, stated once (the pytest plugin's corpus items and
# `replay`): - pass (the default): a saved failure is a regression test: it fails while the bug is
# there and passes once it is fixed; the recorded `result:` is history, shown when it fails; -
# reproduce: the case documents a known bug of its implementation (the mutant corpus, a third-party
# library's bug at a pinned version): it must reproduce its recorded verdict (and hashes on the same
# torch), and pass on the reference.
EXPECT = ("pass", "reproduce")


def to_dict(c: Case) -> dict:
    """The plain-data form, for YAML and JSON, and the inverse of `from_dict`.

    `call`, `inputs` and the variants appear only when they differ from the plain training call
    on contiguous inputs of plain attention. Older cases thus keep their keys and file names.
    """
    d = {
        "format": FORMAT,
        "impl": c.impl,
        "world_size": c.world_size,
        "group_offset": c.group_offset,
        "batch": c.batch,
        "heads_q": c.heads_q,
        "heads_kv": c.heads_kv,
        "head_dim": c.head_dim,
        "seq_lens": list(c.seq_lens),
        "layout": c.layout,
        "mask": c.mask.to_dict(),
        "dtype": c.dtype,
        "softmax_scale": c.softmax_scale,
        "values": c.values,
        "seed": c.seed,
        "faults": [dict(f) for f in c.faults],
        "tolerance": dict(c.tolerance),
        "deadline_s": c.deadline_s,
    }
    if c.call != "train":
        d["call"] = c.call
    if c.inputs != "contiguous":
        d["inputs"] = c.inputs
    # the variants, each only when on: older cases keep their keys and file names
    if c.head_dim_v is not None:
        d["head_dim_v"] = c.head_dim_v
    if c.softcap is not None:
        d["softcap"] = c.softcap
    if c.alibi:
        d["alibi"] = True
    if c.sinks is not None:
        d["sinks"] = list(c.sinks)
    if c.serving is not None:
        d["serving"] = serving_case.to_dict(c.serving)
    return d


def from_dict(d: Any) -> Case:
    """A validated Case from plain data. It raises HarnessError naming the bad field."""
    if not isinstance(d, dict):
        raise HarnessError(f"a case must be a mapping of fields, got {type(d).__name__}")
    unknown = set(d) - FILE_KEYS
    if unknown:
        raise HarnessError(f"unknown case field(s): {', '.join(sorted(map(str, unknown)))}")
    if d.get("expect", "pass") not in EXPECT:
        raise HarnessError(
            f"case field 'expect': must be one of {', '.join(EXPECT)}, got {d.get('expect')!r}"
        )
    if not isinstance(d.get("impl_version", ""), str):
        raise HarnessError(
            f"case field 'impl_version': must be a quoted release string, got {d['impl_version']!r}"
        )
    fmt = d.get("format", FORMAT)
    if fmt != FORMAT:
        raise HarnessError(
            f"case field 'format': unsupported case format {fmt!r} (this version reads {FORMAT})"
        )
    fields = {k: v for k, v in d.items() if k in CASE_KEYS}
    if "mask" in fields:
        fields["mask"] = mask_from_dict(fields["mask"])
    if "seq_lens" in fields:
        if not isinstance(fields["seq_lens"], list):
            raise HarnessError(
                f"case field 'seq_lens': must be a list of integers, got {fields['seq_lens']!r}"
            )
        fields["seq_lens"] = tuple(fields["seq_lens"])
    if isinstance(fields.get("sinks"), list):
        fields["sinks"] = tuple(fields["sinks"])
    if "faults" in fields:
        if not isinstance(fields["faults"], list):
            raise HarnessError(f"case field 'faults': must be a list, got {fields['faults']!r}")
        fields["faults"] = tuple(fields["faults"])
    if "tolerance" in fields and fields["tolerance"] is None:
        fields["tolerance"] = {}
    total = d.get("total_len")
    if total is not None:
        if "seq_lens" in d:
            raise HarnessError("case fields 'total_len' and 'seq_lens' are exclusive: give one")
        w = fields.get("world_size", 4)
        limits.case_field("total_len", total)
        limits.case_field("world_size", w)
        fields["seq_lens"] = tuple(split_lengths(total, w))
    elif "world_size" in fields and "seq_lens" not in fields and "serving" not in fields:
        raise HarnessError("case needs 'seq_lens' (per-rank lengths) or 'total_len'")
    if "serving" in fields:
        limits.case_field("world_size", fields.get("world_size", 4))
        _derive_serving(fields)
    try:
        return Case(**fields)
    # A wrongly typed field, which the dataclass's construction rejects.
    except TypeError as e:
        raise HarnessError(f"bad case: {e}") from None


def loads(text: str, source: str = "<string>") -> tuple[Case, dict]:
    """Parse YAML text into (Case, the whole mapping).

    Only a safe loader reads it, within limits (harness.case_yaml): a case file is data. For a
    sequence file, the Case is its last member, the failing one. `is_sequence(mapping)` tells the two forms apart.
    """
    data = case_yaml.loads(text, source)
    if data is None:
        raise HarnessError(f"{source}: empty case file")
    try:
        if is_sequence(data):
            return sequence_members(data)[-1][0], data
        return from_dict(data), data
    except HarnessError as e:
        raise HarnessError(f"{source}: {e}") from None


def load(path: str | os.PathLike) -> tuple[Case, dict]:
    """Read a case file: (Case, the whole mapping, with any recorded `result`)."""
    p = Path(path)
    text = case_yaml.read(p)
    return loads(text, str(p))


class _Dumper(yaml.SafeDumper):
    """safe_dump, plus str-valued enums written as their plain value.

    A `Verdict` in a recorded result is one.
    """


_Dumper.add_multi_representer(enum.Enum, lambda d, v: d.represent_data(v.value))


def dumps(
    c: Case, *, result: dict | None = None, note: str | None = None, expect: str | None = None
) -> str:
    """YAML text of a case, with an optional recorded result, `expect` and a leading comment."""
    d = to_dict(c)
    if expect is not None:
        d["expect"] = expect
    if result is not None:
        d["result"] = result
    return yaml_text(d, note)


def yaml_text(d: dict, note: str | None = None) -> str:
    """The YAML text of a case file's mapping, `note` as a leading comment."""
    text = yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=100)
    if note:
        text = "".join(f"# {line}\n" for line in note.splitlines()) + text
    return text


def save(
    c: Case,
    path: str | os.PathLike,
    *,
    result: dict | None = None,
    note: str | None = None,
    expect: str | None = None,
) -> Path:
    """Write a case file atomically: a crash never leaves a half-written case.

    A path that cannot be written gets a fallback file, printed (harness.outputs.write).
    """
    return outputs.write(Path(path), dumps(c, result=result, note=note, expect=expect), "case file")


# -- sequence files -----------------------------------------------------------------------------

MAX_SEQUENCE = 256
SEQUENCE_KEYS = {"format", "sequence", "expect", "note"}
STEP_KEYS = (FILE_KEYS - {"expect", "note"}) | {"leak_check"}


def is_sequence(data: Any) -> bool:
    """Whether a loaded mapping is a sequence case file, with a top-level `sequence:` list."""
    return isinstance(data, dict) and "sequence" in data


def recorded_result(data: dict) -> dict:
    """The recorded `result:` of a loaded case or sequence file, or {}.

    For a sequence file it is the last member's.
    """
    if is_sequence(data):
        seq = data.get("sequence") or [{}]
        return (seq[-1] if isinstance(seq[-1], dict) else {}).get("result") or {}
    return data.get("result") or {}


def sequence_members(d: Any) -> list[tuple[Case, bool]]:
    """A sequence file's members, validated.

    Each is a pair: the case, and whether its run included the leak run. A bad member raises
    HarnessError naming the member and the field.
    """
    if not isinstance(d, dict):
        raise HarnessError(f"a sequence case must be a mapping, got {type(d).__name__}")
    unknown = set(d) - SEQUENCE_KEYS
    if unknown:
        raise HarnessError(
            f"unknown sequence field(s): {', '.join(sorted(map(str, unknown)))} "
            f"(a sequence file has {', '.join(sorted(SEQUENCE_KEYS))}; case fields "
            "go in its members)"
        )
    if d.get("expect", "pass") not in EXPECT:
        raise HarnessError(
            f"case field 'expect': must be one of {', '.join(EXPECT)}, got {d.get('expect')!r}"
        )
    fmt = d.get("format", FORMAT)
    if fmt != FORMAT:
        raise HarnessError(
            f"case field 'format': unsupported case format {fmt!r} (this version reads {FORMAT})"
        )
    members = d.get("sequence")
    if not isinstance(members, list) or not members:
        raise HarnessError(f"'sequence' must be a non-empty list of case mappings, got {members!r}")
    if len(members) > MAX_SEQUENCE:
        raise HarnessError(f"'sequence' has {len(members)} cases; at most {MAX_SEQUENCE}")
    steps = []
    for i, m in enumerate(members):
        where = f"sequence[{i}]"
        if not isinstance(m, dict):
            raise HarnessError(
                f"{where}: a case must be a mapping of fields, got {type(m).__name__}"
            )
        unknown = set(m) - STEP_KEYS
        if unknown:
            raise HarnessError(
                f"{where}: unknown case field(s): {', '.join(sorted(map(str, unknown)))}"
            )
        if "result" in m and i != len(members) - 1:
            raise HarnessError(f"{where}: only the last case of a sequence carries a 'result'")
        leak = m.get("leak_check", True)
        if not isinstance(leak, bool):
            raise HarnessError(
                f"{where}: case field 'leak_check': must be true or false, got {leak!r}"
            )
        try:
            steps.append((from_dict({k: v for k, v in m.items() if k != "leak_check"}), leak))
        except HarnessError as e:
            raise HarnessError(f"{where}: {e}") from None
    return steps
