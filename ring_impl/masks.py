"""Attention masks decided by the global positions of query and key tokens.

Because a mask is a function of global positions only, one kernel serves every layout and every
uneven split: a block's mask is `allowed(spec, q_positions, k_positions)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MASK_KINDS = ("none", "causal", "window", "document")


@dataclass(frozen=True)
class MaskSpec:
    """kind: none | causal | window | document.

    window: query i sees keys j with i - window <= j <= i (flash-attn's window_size=(window, 0)).
    doc_starts: for document masks, sorted global start positions of the packed documents
    (the first must be 0); attention stays inside a document, causal or not (`causal`).
    """

    kind: str = "none"
    window: int | None = None
    doc_starts: tuple[int, ...] = field(default_factory=tuple)
    causal: bool = True

    def __post_init__(self) -> None:
        if self.kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.kind!r}; expected one of {', '.join(MASK_KINDS)}")
        if self.kind == "window" and (self.window is None or int(self.window) < 0):
            raise ValueError(f"window mask needs a window >= 0, got {self.window!r}")
        if self.kind == "document":
            starts = tuple(int(s) for s in self.doc_starts)
            if not starts or starts[0] != 0:
                raise ValueError(f"document mask needs doc_starts beginning with 0, got {list(starts)}")
            if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
                raise ValueError(f"doc_starts must be strictly increasing, got {list(starts)}")
            object.__setattr__(self, "doc_starts", starts)

    @property
    def is_causal(self) -> bool:
        """True when no query may see a later key."""
        return self.kind in ("causal", "window") or (self.kind == "document" and self.causal)

    def to_dict(self) -> dict:
        if self.kind == "none" or self.kind == "causal":
            return {"kind": self.kind}
        if self.kind == "window":
            return {"kind": "window", "window": int(self.window)}
        return {"kind": "document", "doc_starts": list(self.doc_starts), "causal": bool(self.causal)}


def doc_ids(spec: MaskSpec, pos: torch.Tensor) -> torch.Tensor:
    """Document index of each global position (document masks only)."""
    starts = torch.tensor(spec.doc_starts, dtype=torch.long, device=pos.device)
    return torch.searchsorted(starts, pos, right=True) - 1


def allowed(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Bool (len_q, len_k): True where query may attend key. None means everything is allowed."""
    if spec.kind == "none":
        return None
    qp = q_pos.view(-1, 1)
    kp = k_pos.view(1, -1)
    if spec.kind == "causal":
        return kp <= qp
    if spec.kind == "window":
        return (kp <= qp) & (kp >= qp - int(spec.window))
    same = doc_ids(spec, q_pos).view(-1, 1) == doc_ids(spec, k_pos).view(1, -1)
    return same & (kp <= qp) if spec.causal else same


def block_is_empty(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when no query of the block may see any key of it, so the block can be skipped."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return True
    if spec.kind == "none":
        return False
    if spec.kind == "causal":
        return bool(k_pos.min() > q_pos.max())
    m = allowed(spec, q_pos, k_pos)
    return not bool(m.any())


def full_mask(spec: MaskSpec, total: int) -> torch.Tensor | None:
    """The (total, total) mask of the whole sequence, for single-device references."""
    pos = torch.arange(total, dtype=torch.long)
    return allowed(spec, pos, pos)


def visible_keys(spec: MaskSpec, queries: Sequence[int] | torch.Tensor, total: int) -> torch.Tensor:
    """Bool (total,): keys that at least one of `queries` may attend."""
    q = torch.as_tensor(queries, dtype=torch.long).view(-1)
    m = allowed(spec, q, torch.arange(total, dtype=torch.long))
    if m is None:
        return torch.ones(total, dtype=torch.bool)
    return m.any(dim=0)
