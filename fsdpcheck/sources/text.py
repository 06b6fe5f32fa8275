"""How errors and values read from a file appear in messages: one line, bounded in size."""

from __future__ import annotations

import reprlib
from typing import Any


def one_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (libraries' messages can span many)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text[:300] + (" ..." if len(lines) > 1 or len(text) > 300 else "")


# Values read from a file appear in messages and key names only through `show_value`: a
# bounded depth and length, so a self-referencing, million-deep or exponentially shared
# structure cannot make a message huge, recurse or never finish.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def show_value(value: Any) -> str:
    """A short repr of a value read from a file (see `_REPR`)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a repr that fails (or recurses) still gets named
        return f"<{type(value).__name__}>"
