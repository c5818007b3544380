"""Reading a case file's YAML within limits: its size, nesting depth, node count and aliases.

A case file is data from anywhere. PyYAML's safe loader runs no code, but a file nested thousands
deep overflows Python's stack. A few aliases can stand for millions of nodes. A huge file takes
minutes to parse. Each limit is refused in one line, before the schema reads the data.
The largest case file the harness writes is a 256-case sequence: ~90 KiB, ~12,000 nodes, depth
under 25. The pure-Python parser reads ~30,000 nodes a second, so the limits also bound the time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from harness.errors import HarnessError

MAX_BYTES = 1 << 20
MAX_DEPTH = 40
MAX_NODES = 50_000  # after alias expansion: an alias counts every node it stands for
MAX_ALIASES = 10_000


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader whose composer counts depth, nodes and aliases as it builds the node tree."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.nodes = 0
        self.aliases = 0
        self.sizes: dict[int, int] = {}  # id(node) -> the nodes it stands for, itself included

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Limit(f"more than {MAX_ALIASES} aliases")
            node = self.anchors.get(self.peek_event().anchor)
            self._count(self.sizes.get(id(node), 1))
            return super().compose_node(parent, index)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Limit(f"nested deeper than {MAX_DEPTH} levels")
        start = self.nodes
        self._count(1)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        self.sizes[id(node)] = self.nodes - start
        return node

    def _count(self, n: int) -> None:
        self.nodes += n
        if self.nodes > MAX_NODES:
            raise _Limit(f"more than {MAX_NODES:,} nodes (aliases expanded)")


class _Limit(Exception):
    """A limit passed; `loads` turns it into one HarnessError line."""


def loads(text: str, source: str = "<string>") -> Any:
    """The data of a YAML text, within the limits; one HarnessError line otherwise."""
    if len(text) > MAX_BYTES:
        raise HarnessError(f"{source}: larger than {MAX_BYTES >> 20} MiB: not a case file")
    loader = _LimitedLoader(text)
    try:
        return loader.get_single_data()
    except _Limit as e:
        raise HarnessError(f"{source}: {e}: not a case file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise HarnessError(
            f"{source}:{where} malformed YAML ({getattr(e, 'problem', None) or e})"
        ) from None
    finally:
        loader.dispose()


def read(path: str | os.PathLike) -> str:
    """A case file's text: at most MAX_BYTES, UTF-8, a regular file (never a device or a pipe)."""
    p = Path(path)
    try:
        if p.exists() and not p.is_file():
            what = "a directory" if p.is_dir() else "not a regular file"
            raise HarnessError(f"cannot read case file {p}: {what}")
        with p.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise HarnessError(f"cannot read case file {p}: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise HarnessError(f"{p}: larger than {MAX_BYTES >> 20} MiB: not a case file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HarnessError(f"{p}: not a UTF-8 text file (byte {e.start})") from None
