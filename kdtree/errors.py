"""The one exception that means "bad input", for everything a user can fix: an option, a path, a capture file, a
setting, a machine without what a command needs. The CLI prints it on one line and exits 2; any other exception
out of kdtree is a bug, shown with its traceback (`kdtree.cli`)."""

from __future__ import annotations


class BadInput(ValueError):
    """Input that cannot be used, in one line naming what and where. A ValueError, so code that catches
    ValueError from a parameter check still does."""


def printable(text: object) -> str:
    """`text` safe for a terminal: bytes of a file name that are not UTF-8 as \\xNN, and control characters (escape
    sequences, newlines, carriage returns) as escapes, so a capture's metadata or name can neither forge a line
    nor drive the terminal."""
    out = []
    for c in str(text):
        if "\udc80" <= c <= "\udcff":  # a byte of a file name that is not UTF-8 (Python's surrogateescape)
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c.isprintable():
            out.append(c)
        else:  # control characters, lone surrogates
            out.append(c.encode("unicode_escape", "backslashreplace").decode("ascii"))
    return "".join(out)
