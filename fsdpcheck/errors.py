r"""fsdpcheck's error vocabulary, in one place: the exceptions, and failures in one line.

The rule: exceptions at the API boundary, problems from readers, findings in reports.

- An exception is raised when a call cannot do what was asked (unreadable input, a checkpoint of
  the wrong kind, a manifest that is not valid). Every one of fsdpcheck's own derives from
  ``FsdpcheckError`` and from the standard type callers already catch (``ValueError``,
  ``RuntimeError``, ``AssertionError``), and its message is one line naming the key, the file,
  the rank and the fix. ``dist.runner`` raises on every rank the type one rank raised, looked
  up in ``REGISTRY`` here.
- A reader that finds something wrong with storage it can still partly read records a
  ``Problem`` (``sources.base``); verify and compare turn problems into findings.
- A ``Finding`` (``report``) is a verdict about one key.

``describe_error`` is the one way a failure becomes words for a user: the root cause named
(DCP's gathered exception unwrapped to the failing rank's, a system error a library swallowed
brought back), no repr, no traceback, every character from a file made visible (``shown``).
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any


def shown(text: object) -> str:
    r"""`text` as it may reach a terminal: every character that is not printable made visible.

    Line breaks, carriage returns, NUL, ESC (colour and cursor codes), bidi overrides and other
    control or format characters, lone surrogates (undecodable file names) and separators other
    than the space become Python escapes (``\n``, ``\x1b``, ``\u202e``), so a key, a path or a
    message read from a file can neither start a line, nor rewrite one, nor colour one.
    Backslashes stay as they are, so applying it twice changes nothing.
    """
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escaped(c) for c in s)


def _escaped(c: str) -> str:
    return c.encode("unicode_escape", "backslashreplace").decode("ascii")


class FsdpcheckError(Exception):
    """What every exception fsdpcheck raises on purpose derives from (with a standard type).

    Its message is one printable line: names read from a file are escaped (``shown``).
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(shown(message))


class CheckpointError(FsdpcheckError, ValueError):
    """A checkpoint file is malformed, inconsistent or refused: unreadable input.

    The message is one line naming the file (and the key where there is one). It is not a
    verdict on the values.
    """


class CoverageError(CheckpointError):
    """A read asked for a region of a tensor that no saved chunk covers (a gap).

    There is no data to return, and an uninitialised buffer is never returned instead.
    """


class ObjectStoreError(CheckpointError):
    """An object store failed a read (one line naming the object and what to do).

    The object changed while it was read, is shorter than listed, or the store throttled,
    failed or did not answer.
    """


class ManifestError(FsdpcheckError, ValueError):
    """A manifest that is not valid (the message names the file and the field)."""


class FingerprintError(FsdpcheckError, ValueError):
    """A value cannot be fingerprinted (a Partial placement, a layout that is not a box, ...)."""


class CheckpointKindError(FsdpcheckError, ValueError):
    """The checkpoint is not of the kind the caller insisted on (nothing was loaded)."""


class UnsafePickleError(FsdpcheckError, pickle.UnpicklingError, ValueError):
    """A pickle names a class or function outside the allowlist; nothing of it was run."""


class RankStoppedError(FsdpcheckError, RuntimeError):
    """A rank stopped answering in the middle of a collective (it died, or hangs elsewhere).

    Raised on every rank that still answers, with the same message: the rank(s) that did not,
    the step, and the reason ("connection reset by peer", "no answer within 30 min", ...).
    """


class RanksDisagreeError(FsdpcheckError, ValueError):
    """The ranks called fsdpcheck with arguments (or found inputs) that must agree but differ.

    Raised on every rank before anything was done, naming the argument and the ranks.
    """


class ConcurrentCallError(FsdpcheckError, RuntimeError):
    """A second thread called fsdpcheck on a process group a call was already using.

    The second call is refused at once; the call in progress fails on every rank (the two
    calls' collectives could otherwise have been paired across ranks).
    """


class OfflineError(FsdpcheckError, ValueError):
    """An error of some processes of a torchrun launch, worded the same on every process."""


class VerificationError(FsdpcheckError, AssertionError):
    """Raised by ``Report.raise_if_failed``; its message is the report."""

    def __init__(self, message: str = "") -> None:
        Exception.__init__(self, message)  # the report is rendered already (lines kept)


#: Exception types ``dist.runner`` raises as themselves on every rank, by name (others become
#: RuntimeError): fsdpcheck's own and the standard ones a message already explains.
REGISTRY: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        FileNotFoundError,
        FileExistsError,
        ImportError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        ValueError,
        TypeError,
        CheckpointError,
        CoverageError,
        ObjectStoreError,
        ManifestError,
        FingerprintError,
        CheckpointKindError,
        UnsafePickleError,
        RanksDisagreeError,
        ConcurrentCallError,
        OfflineError,
    )
}


def type_name(exc: BaseException) -> str:
    """The name in ``REGISTRY`` of the nearest type of `exc` (else "RuntimeError")."""
    for t in type(exc).__mro__:
        if t.__name__ in REGISTRY and REGISTRY[t.__name__] is t:
            return t.__name__
    return "RuntimeError"


# Exceptions whose message says what happened without their type's name.
_WORDS_SUFFICE = (OSError, ValueError, TypeError, LookupError)


def describe_error(exc: BaseException) -> str:
    """An exception in one line, in words: the root cause named, no repr, no traceback.

    A DCP ``CheckpointException`` is unwrapped to the first failing rank's own exception, and a
    library error to the system error it swallowed (`root_cause`); an OSError becomes its file
    and its system message ("No space left on device"); fsdpcheck's own errors and the usual
    unreadable-input types are their message alone, escaped (`shown`); anything else (a bug)
    keeps its type, its first line and where it was raised.
    """
    _, exc = root_cause(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return shown(f"{where}{exc.strerror}")
    text = str(exc).strip()
    if isinstance(exc, _WORDS_SUFFICE) and not isinstance(exc, KeyError) and text:
        # Written for people, often with a path in it: whole (a line break in a file name is
        # data, shown escaped), up to a length (fsdpcheck's own name a file, a key and a rank
        # and say what to do: longer, so the end is not cut off).
        return _capped(shown(text), 1200 if isinstance(exc, FsdpcheckError) else 400)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    first = _capped(lines[0].strip()) if lines else ""
    if len(lines) > 1 and not first.endswith(" ..."):
        first += " ..."  # other libraries' messages can span a page: their first line
    tb = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    loc = f" (at {tb[0].filename.rsplit('/', 1)[-1]}:{tb[0].lineno})" if tb else ""
    return shown(f"{type(exc).__name__}{': ' if first else ''}{first}{loc}")


def _capped(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def root_cause(exc: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception): what really failed, and on which rank when DCP says.

    DCP gathers every rank's failure into one exception whose text is a traceback per rank and
    whose ``failures`` map ranks to ``(exception, stack summary)`` pairs (older torch: objects
    with ``.exc``): the first failing rank's own exception is taken. An error raised while
    handling a system error (torch's zip writer reports a full disk as "unexpected pos 704 vs
    598" while the OSError it swallowed is its context) gives way to that OSError, unless its
    raiser replaced it on purpose (``raise ... from None``) or wrote it for people (fsdpcheck's
    errors, OSError, ValueError, ...). No rank: None.
    """
    rank = None
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner: Any = failures[rank]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]
        inner = getattr(inner, "exc", None) or inner
        if isinstance(inner, BaseException):
            exc = inner
    if isinstance(exc, _WORDS_SUFFICE):  # a message written for people already
        return rank, exc
    seen = {id(exc)}
    link: BaseException | None = exc
    while link is not None:
        if isinstance(link, OSError) and link.errno is not None and link is not exc:
            return rank, link
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
        if link is not None and id(link) in seen:
            break
        seen.add(id(link))
    return rank, exc


__all__ = [
    "REGISTRY",
    "CheckpointError",
    "CheckpointKindError",
    "ConcurrentCallError",
    "CoverageError",
    "FingerprintError",
    "FsdpcheckError",
    "ManifestError",
    "OfflineError",
    "RankStoppedError",
    "RanksDisagreeError",
    "UnsafePickleError",
    "VerificationError",
    "describe_error",
    "root_cause",
    "shown",
    "type_name",
]
