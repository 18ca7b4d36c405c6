"""kdtree's own small files, read as untrusted input and written so that nothing is lost: verdicts, tuning files,
reports, captures. A reader never blocks (a FIFO or a device at the path is refused, not opened for reading) and
never reads more than its bound; a writer's file is whole or absent (a temporary file in the same folder, fsynced,
renamed over the path, the folder fsynced), and a failed write leaves no temporary file and the old file intact."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

SMALL_FILE_BYTES = 1 << 20  # a verdict, tuning file or report is a few KB
_UMASK = os.umask(0o022)  # read once, at import (umask is process-wide: setting it later races other threads)
os.umask(_UMASK)


class UnreadableFile(Exception):
    """A file kdtree reads is not what it wrote: not a regular file, too large, not UTF-8, unreadable. The message
    names the file and why."""


def read_small_text(path: str | os.PathLike, limit: int = SMALL_FILE_BYTES) -> str | None:
    """The UTF-8 text of the regular file at `path`, or None where nothing is there; UnreadableFile otherwise.
    Opened non-blocking and checked on its descriptor, so a FIFO swapped in between never stalls the reader."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file where a folder on the way should be
        return None
    except OSError as e:
        raise UnreadableFile(f"{path}: cannot be read ({e.strerror or e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{path}: not a regular file")
        if st.st_size > limit:
            raise UnreadableFile(f"{path}: {st.st_size:,} B, more than the {limit:,} B such a file can have")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UnreadableFile(f"{path}: more than the {limit:,} B such a file can have")
    except OSError as e:
        raise UnreadableFile(f"{path}: cannot be read ({e.strerror or e})") from e
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {e.start})") from e


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, private: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` to write; when the block ends, it is fsynced, given the mode a plain open()
    would give (`private`: 0600, owner only) and renamed over `path`, and the folder is fsynced. An exception in
    the block or in any of that removes the temporary file and propagates (an OSError naming `path` where it named
    no file); `path` is then as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # it names the temporary file, which nobody asked for
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600 if private else 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            _raise_naming(e, path, tmp)
        raise
    with contextlib.suppress(OSError):  # the rename's durability; a folder that cannot be opened loses nothing
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _raise_naming(e: OSError, path: Path, tmp: str | None = None):
    """Raised inside `except`: `e` where it names a file of the user's, else the same error naming `path` (the
    file that could not be written), not the temporary file nobody asked for."""
    if e.filename is None or e.filename == tmp:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    raise e


def parse_json(text: str):
    """json.loads, with what it raises for hostile text (nesting past the recursion limit, a number too large for
    a float) as ValueError, the error any malformed JSON gives."""
    try:
        return json.loads(text)
    except (RecursionError, OverflowError) as e:
        raise ValueError(f"JSON nested or sized past what kdtree reads ({type(e).__name__})") from None


def write_text_atomic(path: str | os.PathLike, text: str, *, private: bool = False) -> Path:
    """`text` written to `path` whole or not at all (`atomic_path`)."""
    with atomic_path(path, private=private) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
