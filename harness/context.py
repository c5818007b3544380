"""The adapter protocol: what an implementation receives (RunContext) and declares (Capabilities).

An implementation is an `Impl`: a plain function `run(q, k, v, ctx)` and its declared capabilities.
`run` returns the local output shard, or `(out, lse)`. The harness calls backward through autograd
with the local dout, and reads the `.grad` of q, k and v.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from harness.calls import INPUT_FORMS
from harness.dtypes import DTYPES, TORCH_DTYPES  # noqa: F401 - re-exported (`from harness.context import DTYPES`)
from harness.errors import ImplError
from ring_impl.layouts import LAYOUTS
from ring_impl.masks import MASK_FEATURES, MASK_KINDS, MaskSpec
from ring_impl.paged import PagedKV
from ring_impl.serving import KV_LAYOUTS, QUERY_FORMS

# the forms the inputs may come in: q, k, v and dout's views (harness.calls), and a paged KV
# cache, which only an implementation that declares it gets (harness.paged)
PAGED = "paged"
KNOWN_INPUT_FORMS = (*INPUT_FORMS, PAGED)

SHAPES = ("train", "prefill", "decode")
LSE_BASES = ("e", "2")


@dataclass(frozen=True)
class ServingInfo:
    """A serving case's requests, as every rank sees them (docs/case-model.md, "Inference shapes").

    Requests are packed along the tokens: request r is global positions starts[r] .. starts[r] +
    context[r] + new[r] - 1, its new tokens last. `kv_lengths[g][r]` is how many of request r's
    tokens rank g holds; a rank's KV is its tokens of request 0, then of request 1, and so on.
    """

    context: tuple[int, ...]
    new: tuple[int, ...]
    starts: tuple[int, ...]
    kv: str  # contiguous | interleaved | zigzag | striped
    interleave: int  # I: token t on rank floor(t / I) mod W, for kv = interleaved
    queries: str  # own: a rank holds the new tokens it holds the KV of; replicated: every one
    kv_lengths: tuple[tuple[int, ...], ...]
    page_size: int = 0  # P >= 1: k and v come as pools of P-token pages (RunContext.pages)


@dataclass(frozen=True)
class RunContext:
    """Everything an adapter may need to know about one run on one rank.

    The q, k and v shards are (batch, seq_local, heads, head_dim). `rank` and `world_size` are ranks
    in `group`. `global_ranks[r]` is the global rank of group rank r: use it for P2P peers.
    `all_positions[r]` are the global token positions that group rank r holds, in local order.
    """

    group: Any  # torch.distributed.ProcessGroup (None only in single-process unit tests)
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    layout: str
    lengths: tuple[int, ...]
    all_positions: tuple[torch.Tensor, ...]
    mask: MaskSpec
    softmax_scale: float
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    extra: dict = field(default_factory=dict)
    # the attention variants (docs/case-model.md); None: plain attention
    sinks: torch.Tensor | None = None  # float32 (heads_q,); with a backward it requires grad
    softcap: float | None = None  # scores become cap * tanh(s / cap)
    alibi_slopes: torch.Tensor | None = None  # float32 (heads_q,): -slope * |p_i - p_j|, global
    head_dim_v: int | None = None  # v's head dim when it differs from q's and k's
    # an inference shape (docs/case-model.md): every rank's query rows' global positions (None:
    # each rank's queries are its own tokens, `all_positions`), and the requests
    query_positions: tuple[torch.Tensor, ...] | None = None
    serving: ServingInfo | None = None
    # a paged KV cache: k and v are page pools (pages, P, heads, dim), read by these block tables
    pages: PagedKV | None = None

    @property
    def q_positions(self) -> torch.Tensor:
        """Global positions of this rank's query rows (its own tokens in a training case)."""
        every = self.all_positions if self.query_positions is None else self.query_positions
        return every[self.rank]

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants this run uses, by their capability names (`VARIANTS`)."""
        on = (self.sinks, self.softcap, self.alibi_slopes, self.head_dim_v)
        return tuple(name for name, x in zip(VARIANTS, on, strict=True) if x is not None)

    @property
    def positions(self) -> torch.Tensor:
        """Global positions of this rank's tokens."""
        return self.all_positions[self.rank]

    @property
    def total_len(self) -> int:
        return sum(self.lengths)


# the attention variants, by their capability (and Case.variants) names
VARIANTS = ("sinks", "softcap", "alibi", "head_dim_v")
VARIANT_WORDS = {
    "sinks": "learned attention sinks",
    "softcap": "logit softcapping",
    "alibi": "ALiBi position biases",
    "head_dim_v": "a value head dim of its own",
}
# each variant's plain value: what a case without the variant holds in its field
PLAIN_VARIANT = {"sinks": None, "softcap": None, "alibi": False, "head_dim_v": None}
# flash-attention's common block sizes (query and key tiles of 64 or 128 tokens)
DEFAULT_TILES = (64, 128)
DEVICES = ("cpu", "cuda")
# `Capabilities(backends=...)`, the old name: each process-group backend stood for its device
BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True)
class Capabilities:
    """What an implementation declares it supports. Property-based runs draw only from this."""

    layouts: frozenset[str] = frozenset(LAYOUTS)
    masks: frozenset[str] = frozenset(MASK_KINDS)
    dtypes: frozenset[str] = frozenset(DTYPES)
    gqa: bool = True
    uneven: bool = True
    world_sizes: tuple[int, int] = (1, 8)  # inclusive range
    backward: bool = True
    # where the ring's tensors may live: cpu, cuda
    devices: frozenset[str] = frozenset(DEVICES)
    returns_lse: bool = False
    head_dims: tuple[int, ...] | None = None  # None: any head_dim
    # False: the ring must be the whole world, global ranks 0..W-1
    subgroups: bool = True
    # False: in the zigzag layout every local length must be even (two equal chunks per rank)
    zigzag_odd: bool = True
    # True: heads_q and heads_kv must be multiples of W (Ulysses head split)
    heads_divisible_by_world: bool = False
    # True: a rank may hold no token at all (some seq_lens are zero, never all)
    idle_ranks: bool = False
    # the kernel's tile sizes in tokens: the scale stage aims at their edges
    tiles: tuple[int, ...] = DEFAULT_TILES
    # the forms q, k, v, dout may come in (harness.calls)
    input_forms: frozenset[str] = frozenset(INPUT_FORMS)
    # the attention variants it runs (docs/case-model.md): each False unless declared
    sinks: bool = False  # learned sinks in ctx.sinks; their gradient is judged
    softcap: bool = False  # ctx.softcap
    alibi: bool = False  # ctx.alibi_slopes, from global positions
    head_dim_v: bool = False  # v with a head dim of its own
    # the inference shapes (docs/case-model.md): train, prefill (onto a cache), decode
    shapes: frozenset[str] = frozenset({"train"})
    kv_layouts: frozenset[str] = frozenset(KV_LAYOUTS)  # how a serving case's KV is spread
    queries: frozenset[str] = frozenset({"own"})  # own, replicated
    lse_base: str = "e"  # the base of the returned lse: e (natural log) or 2
    # the old name of `devices`: when given, it sets them (gloo means cpu, nccl means cuda)
    backends: InitVar[Iterable[str] | None] = None

    def __post_init__(self, backends: Iterable[str] | None) -> None:
        """Check every field and normalise it.

        Any iterable of names becomes a frozenset, and head_dims and tiles become sorted tuples. A
        wrong field raises ImplError naming it. A declaration mistake is thus exit 2, never a run.
        """
        if backends is not None:
            names = _names("backends", backends, tuple(BACKEND_DEVICES))
            object.__setattr__(self, "devices", frozenset(BACKEND_DEVICES[n] for n in names))
        for name, known in (
            ("layouts", LAYOUTS),
            ("masks", MASK_FEATURES),
            ("dtypes", DTYPES),
            ("devices", DEVICES),
            ("input_forms", KNOWN_INPUT_FORMS),
            ("shapes", SHAPES),
            ("kv_layouts", KV_LAYOUTS),
            ("queries", QUERY_FORMS),
        ):
            object.__setattr__(self, name, _names(name, getattr(self, name), known))
        for name in (
            "gqa",
            "uneven",
            "backward",
            "returns_lse",
            "subgroups",
            "zigzag_odd",
            "heads_divisible_by_world",
            "idle_ranks",
            *VARIANTS,
        ):
            if not isinstance(getattr(self, name), bool):
                raise ImplError(
                    f"Capabilities.{name}: expected True or False, got {getattr(self, name)!r}"
                )
        if self.lse_base not in LSE_BASES:
            raise ImplError(f"Capabilities.lse_base: expected 'e' or '2', got {self.lse_base!r}")
        if "train" not in self.shapes:
            raise ImplError(
                "Capabilities.shapes: must include 'train': the check's stages run training "
                "shapes, and inference shapes join them (docs/case-model.md)"
            )
        ws = self.world_sizes
        if not (
            isinstance(ws, (tuple, list))
            and len(ws) == 2
            and all(_is_int(w) for w in ws)
            and 1 <= ws[0] <= ws[1]
        ):
            raise ImplError(
                "Capabilities.world_sizes: expected an inclusive range (lo, hi) of "
                "ring sizes with "
                f"1 <= lo <= hi, e.g. (1, 8); got {ws!r}"
            )
        object.__setattr__(self, "world_sizes", (int(ws[0]), int(ws[1])))
        if self.head_dims is not None:
            object.__setattr__(
                self, "head_dims", _ints("head_dims", self.head_dims, "e.g. (64, 128)", 1 << 16)
            )
        object.__setattr__(
            self,
            "tiles",
            _ints("tiles", self.tiles, "tile sizes in tokens, e.g. (64, 128)", 1 << 16),
        )

    def to_dict(self) -> dict:
        return {
            "layouts": sorted(self.layouts),
            "masks": sorted(self.masks),
            "dtypes": sorted(self.dtypes),
            "gqa": self.gqa,
            "uneven": self.uneven,
            "world_sizes": list(self.world_sizes),
            "backward": self.backward,
            "devices": sorted(self.devices),
            "returns_lse": self.returns_lse,
            "head_dims": None if self.head_dims is None else list(self.head_dims),
            "subgroups": self.subgroups,
            "zigzag_odd": self.zigzag_odd,
            "heads_divisible_by_world": self.heads_divisible_by_world,
            "idle_ranks": self.idle_ranks,
            "tiles": list(self.tiles),
            "input_forms": sorted(self.input_forms),
            **{name: getattr(self, name) for name in VARIANTS},
            "shapes": sorted(self.shapes),
            "kv_layouts": sorted(self.kv_layouts),
            "queries": sorted(self.queries),
            "lse_base": self.lse_base,
        }

    @property
    def variants(self) -> frozenset[str]:
        """The variants it declares."""
        return frozenset(name for name in VARIANTS if getattr(self, name))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _names(field_name: str, value: Any, known: tuple[str, ...]) -> frozenset[str]:
    """Any iterable of known names (set, tuple, list) as a frozenset, else one ImplError line."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ImplError(
            f"Capabilities.{field_name}: expected a collection of names, e.g. "
            f"{{{known[0]!r}}}; "
            f"got {value!r}"
        )
    names = list(value)
    bad = [n for n in names if not isinstance(n, str) or n not in known]
    if bad:
        raise ImplError(
            f"Capabilities.{field_name}: unknown {field_name[:-1]} {bad[0]!r}; "
            "expected some of "
            f"{', '.join(known)}"
        )
    return frozenset(names)


def _ints(field_name: str, value: Any, example: str, hi: int) -> tuple[int, ...]:
    """Positive integers, one or a collection, as a sorted tuple, else one ImplError line."""
    items = (value,) if _is_int(value) else value
    items = None if isinstance(items, str) or not isinstance(items, Iterable) else list(items)
    if not items or not all(_is_int(x) and 1 <= x <= hi for x in items):
        raise ImplError(
            f"Capabilities.{field_name}: expected integers 1..{hi}, {example}; got {value!r}"
        )
    return tuple(sorted(set(items)))


RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RunContext], Any]


@dataclass(frozen=True)
class Impl:
    """A named implementation: `run(q, k, v, ctx) -> out | (out, lse)` and its capabilities.

    The lse, when returned, is float32 (batch, heads_q, seq_local) in natural log. `deterministic`
    means bit-identical outputs for identical inputs. Replay compares hashes when it holds.
    """

    name: str
    run: RunFn
    capabilities: Capabilities = field(default_factory=Capabilities)
    version: str = "unknown"
    deterministic: bool = True
    # False: a bare function; its capabilities are the defaults, not a declaration
    declared: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ImplError(f"Impl.name: expected a non-empty string, got {self.name!r}")
        if not callable(self.run):
            raise ImplError(
                f"Impl {self.name!r}: run must be a callable run(q, k, v, ctx), got {self.run!r}"
            )
        if not isinstance(self.capabilities, Capabilities):
            raise ImplError(
                f"Impl {self.name!r}: capabilities must be a "
                "harness.Capabilities(...), got "
                f"{type(self.capabilities).__name__}"
            )
        for name in ("deterministic", "declared"):
            if not isinstance(getattr(self, name), bool):
                raise ImplError(
                    f"Impl {self.name!r}: {name} must be True or False, got {getattr(self, name)!r}"
                )
