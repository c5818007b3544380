"""The inference shapes' features, for failure groups: what a serving case's failures share, and
the one-feature changes that explain them by experiment (issue #54).

`FEATURES` joins `harness.checks.shared_features.FEATURES` and `CHANGES` joins
`harness.checks.experiments.CHANGES`, under the same names. A training case has the shape
"train", and no KV distribution, query form, new tokens, interleave or pages of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from harness.case import Case
from harness.serving_case import seq_lens
from ring_impl.serving import KV_LAYOUTS

Changes = Iterator[tuple[str, dict]]
SHAPE_ORDER = ("train", "decode", "prefill")  # plainest first


def kv_of(c: Case) -> str:
    return "training" if c.serving is None else c.serving.kv


def queries_of(c: Case) -> str:
    """A training case's queries are its own tokens."""
    return "own" if c.serving is None else c.serving.queries


def new_of(c: Case) -> int:
    return 0 if c.serving is None else max(c.serving.new)


def paged_of(c: Case) -> bool:
    return c.serving is not None and c.serving.page_size > 0


def interleave_of(c: Case) -> int:
    return 0 if c.serving is None or c.serving.kv != "interleaved" else c.serving.interleave


def _served(c: Case, words: str, **changes) -> Changes:
    """`c` with its requests changed, and its ranks' KV lengths with them."""
    req = dataclasses.replace(c.serving, **changes)
    try:
        lens = seq_lens(req, c.world_size)
    except ValueError:
        return
    yield words, {"serving": req, "seq_lens": lens}


def serving_world(c: Case) -> Changes:
    """W - 1 from W >= 3, else W + 1, the KV spread over the new ranks as before."""
    w = c.world_size - 1 if c.world_size >= 3 else c.world_size + 1
    try:
        lens = seq_lens(c.serving, w)
    except ValueError:
        return
    yield f"W = {w}", {"world_size": w, "seq_lens": lens}


def _shape(c: Case) -> Changes:
    if c.serving is not None:
        yield "a training step on the same tokens", {"serving": None}


def _kv(c: Case) -> Changes:
    if c.serving is None:
        return
    for kv in KV_LAYOUTS:
        if kv != c.serving.kv:
            # token by token: the interleave least like contiguous shares
            yield from _served(c, f"KV {kv}", kv=kv, interleave=1)


def _queries(c: Case) -> Changes:
    if c.serving is not None:
        other = "own" if c.serving.queries == "replicated" else "replicated"
        yield from _served(c, f"{other} queries", queries=other)


def _new(c: Case) -> Changes:
    if c.serving is None:
        return
    n = len(c.serving.new)
    if max(c.serving.new) > 1:
        yield from _served(c, "one new token a request", new=(1,) * n)
    else:
        yield from _served(c, "two new tokens a request", new=(2,) * n)


def _interleave(c: Case) -> Changes:
    if interleave_of(c):
        i = 1 if c.serving.interleave > 1 else 4
        yield from _served(c, f"interleave {i}", interleave=i)


def _pages(c: Case) -> Changes:
    if paged_of(c):
        yield from _served(c, "contiguous KV shares", page_size=0)
        size = 1 if c.serving.page_size > 1 else 16
        yield from _served(c, f"pages of {size} token{'s' if size > 1 else ''}", page_size=size)


CHANGES: tuple[tuple[str, Callable[[Case], Changes]], ...] = (
    ("shape", _shape),
    ("KV distribution", _kv),
    ("queries", _queries),
    ("new tokens", _new),
    ("interleave", _interleave),
    ("pages", _pages),
)
EVERY_VALUE = ("KV distribution",)
PLAIN: dict[str, Callable[[Case], object]] = {
    "shape": lambda c: SHAPE_ORDER.index(c.shape),
    "KV distribution": lambda c: -1 if c.serving is None else KV_LAYOUTS.index(c.serving.kv),
    "queries": lambda c: queries_of(c) == "replicated",
    "new tokens": new_of,
    "interleave": interleave_of,
    "pages": paged_of,
}
