"""Where results go: output paths checked before any work, and writes that never lose a result.

`check_file` and `check_dir` run before any rank starts. A path that cannot be written is one line
naming the path and why, and exit 2. `write` writes atomically; when the path still fails at the end
(a disk filled, a directory removed), the text goes to a fallback file whose path is printed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from harness.errors import HarnessError

FALLBACK_ENV = "RING_HARNESS_FALLBACK_DIR"  # where a result goes when its own path fails


def _nearest_existing(p: Path) -> Path:
    """`p` itself, or the closest of its ancestors that exists."""
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(directory: Path, what: str) -> None:
    """Create and remove a file in `directory`: the only test that a write will succeed there."""
    if not directory.is_dir():
        raise HarnessError(f"{what}: {directory} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ring-harness-probe-", dir=directory)
    except OSError as e:
        raise HarnessError(
            f"{what}: cannot create a file in {directory} ({e.strerror or e})"
        ) from None
    os.close(fd)
    os.unlink(tmp)


def check_file(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse, in one line, an output file `flag PATH` that cannot be written. None passes."""
    if path is None:
        return
    p = Path(path)
    what = f"{flag} {path}"
    if str(path) == "" or p.is_dir():
        raise HarnessError(f"{what}: is a directory, not a file")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise HarnessError(f"{what}: the file exists and cannot be written")
        if not p.is_file():
            return  # a device or a pipe (/dev/null, /dev/stdout): written in place
    _probe(_nearest_existing(p.parent), what)


def check_dir(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse, in one line, an output directory that cannot be written or created. None passes.

    Nothing is created: a run that fails nothing leaves no empty directory behind.
    """
    if path is None:
        return
    p = Path(path)
    what = f"{flag} {path}"
    if str(path) == "":
        raise HarnessError(f"{what}: an empty path")
    if p.exists() and not p.is_dir():
        raise HarnessError(f"{what}: exists and is not a directory")
    _probe(_nearest_existing(p), what)


def write_atomic(p: Path, text: str) -> Path:
    """Write `text` to `p` through a temp file, fsync and rename: never half a file.

    A path that exists and is not a regular file (/dev/null, a pipe) is written in place.
    """
    if p.exists() and not p.is_file():
        with p.open("w", encoding="utf-8") as f:
            f.write(text)
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes 0600, but a result is shared data.
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def fallback_dir() -> Path:
    """$RING_HARNESS_FALLBACK_DIR, else the temp directory."""
    return Path(os.environ.get(FALLBACK_ENV) or tempfile.gettempdir())


def write(path: str | os.PathLike, text: str, flag: str) -> Path:
    """Write `text` to `path`; on failure, to a fallback file, and say where on stderr.

    It returns the path written. When the fallback fails too, the text itself goes to stderr.
    """
    p = Path(path)
    try:
        return write_atomic(p, text)
    except OSError as e:
        why = e.strerror or str(e)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    alt = fallback_dir() / f"ring-harness-fallback-{stamp}-{os.getpid()}-{p.name or 'out'}"
    try:
        write_atomic(alt, text)
    except OSError as e2:
        print(
            f"ring-harness: could not write {flag} {p} ({why}), nor the fallback {alt} "
            f"({e2.strerror or e2}); its text follows",
            file=sys.stderr,
        )
        print(text, file=sys.stderr)
        return p
    print(f"ring-harness: could not write {flag} {p} ({why}); wrote {alt} instead", file=sys.stderr)
    return alt
