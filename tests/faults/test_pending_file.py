"""The pending-ops file a rank leaves before a wait that may block (harness.faults.oplog).

It stays open between writes (issue #55); each write replaces the whole text, padded, and a
removed file is made again at the case's start."""

from __future__ import annotations

from pathlib import Path

from harness.faults import oplog
from harness.faults.interpose import Interposer


def _text(path: str) -> str:
    return Path(path).read_text().strip()


def test_each_write_replaces_the_text_and_readers_strip_the_padding(tmp_path):
    path = str(tmp_path / "pending-0")
    oplog.overwrite(path, "rank 0 last blocked waiting on a long op label\n")
    oplog.overwrite(path, "short\n")
    assert _text(path) == "short"
    oplog.forget(path)


def test_a_removed_file_is_made_again_by_the_next_case(tmp_path):
    path = str(tmp_path / "pending-1")
    Interposer(0, pending_path=path)
    oplog.overwrite(path, "first case\n")
    (tmp_path / "pending-1").unlink()
    Interposer(0, pending_path=path)  # the next case: the kept descriptor is dropped
    oplog.overwrite(path, "second case\n")
    assert _text(path) == "second case"
    Interposer(0, pending_path=path)  # and a case blanks what the last one left
    assert _text(path) == ""
    oplog.forget(path)
