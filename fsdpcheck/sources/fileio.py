"""How checkpoint files are opened, and which paths a checkpoint may name.

Every reader opens its files through `open_regular` (regular files only, checked on what was
opened) and checks the names a checkpoint gives through `relative_path_problem` (nothing
outside the checkpoint's folder).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.text import one_line


def _kind(mode: int) -> str:
    return (
        "a directory" if stat.S_ISDIR(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )  # fmt: skip


def _refused(p: Path, what: str, mode: int) -> CheckpointError:
    return CheckpointError(f"{what} {p} is {_kind(mode)}, not a regular file; refusing to read it")


def check_regular(path: str | os.PathLike[str], what: str = "file") -> Path:
    """`path`, after checking that it is a regular file (symlinks to regular files are fine).

    A check by path, for messages and for what is not opened here; reads open with
    `open_regular`, which checks what it opened.

    Raises:
        FileNotFoundError: It does not exist.
        PermissionError: A folder on the way may not be searched.
        CheckpointError: It is a directory, FIFO, socket or device.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    except PermissionError:
        raise PermissionError(f"{what} {p}: permission denied") from None
    except (ValueError, OSError) as exc:  # a NUL byte, a name too long, ...
        raise CheckpointError(f"{what} {p!r:.200} cannot be opened: {one_line(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(p, what, st.st_mode)
    return p


#: How every checkpoint file is opened: a FIFO opens at once instead of waiting for a writer,
#: a terminal never becomes the controlling one, and the descriptor is not inherited.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def open_regular(path: str | os.PathLike[str], what: str = "file") -> tuple[int, os.stat_result]:
    """An open descriptor of `path` and its ``fstat``, refused unless it is a regular file.

    NOTE: [open by what it is] A check of the path and then an open of it is a race: the file
    can be replaced by a FIFO (the open blocks forever) or a link to ``/dev/zero`` (never ends)
    in between. So the file is opened non-blocking and what was opened is checked
    (``fstat`` on the descriptor); only a regular file is kept. Obvious cases are refused by
    path first, so that a device is not even opened.

    Raises:
        FileNotFoundError: It does not exist.
        PermissionError: It may not be read ("permission denied", naming it).
        CheckpointError: It is a directory, FIFO, socket or device.
    """
    p = Path(path)
    check_regular(p, what)
    try:
        fd = os.open(p, _OPEN_FLAGS)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    except PermissionError:
        raise PermissionError(f"{what} {p}: permission denied") from None
    except OSError as exc:  # a socket (ENXIO), a file that became something else
        try:
            mode = os.stat(p).st_mode
        except OSError:
            mode = 0
        if mode and not stat.S_ISREG(mode):
            raise _refused(p, what, mode) from None
        raise CheckpointError(f"{what} {p} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(p, what, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def relative_path_problem(root: Path, rel: str, real_root: Path | None = None) -> str | None:
    """Why a path a checkpoint names may not be opened (outside the checkpoint), or None.

    `real_root` is ``root.resolve()`` when the caller has it (checks of many files).
    """
    if "\x00" in rel:
        return f"names {rel!r}, which holds a NUL byte (no file can)"
    pure = PurePosixPath(rel)
    if not pure.parts or rel in (".", "./"):
        return f"names {rel!r}, which is not a file"
    if pure.is_absolute() or rel.startswith("\\") or ":" in pure.parts[0]:
        return f"names the absolute path {rel!r}"
    if ".." in pure.parts or "\\" in rel:
        return f"names {rel!r}, outside the checkpoint directory"
    if len(pure.parts) == 1 and not os.path.islink(root / rel):
        return None  # a plain name in the folder (the common case: no resolving needed)
    real_root = real_root or root.resolve()
    target = (root / rel).resolve()
    if target != real_root and real_root not in target.parents:
        return f"names {rel!r}, a link that leads outside the checkpoint directory"
    return None


def file_size(
    root: Path, rel: str, what: str, real_root: Path | None = None
) -> tuple[str | None, int]:
    """(why `rel` under `root` cannot be read at all, or None; its size in bytes)."""
    bad = relative_path_problem(root, rel, real_root)
    if bad is not None:
        return f"{what} {bad}", 0
    try:
        fd, st = open_regular(root / rel, "data file")
    except (FileNotFoundError, PermissionError, CheckpointError) as exc:
        return f"{what}: {exc}", 0
    os.close(fd)
    return None, st.st_size


def past_the_end(what: str, end: int, rel: str, size: int) -> str:
    """The one line for bytes that end past the end of their file."""
    return f"{what} ends at byte {end} of {rel} but the file has {size} bytes (truncated?)"


def file_problem(root: Path, rel: str, end: int, what: str) -> str | None:
    """Why bytes ``[.., end)`` of `rel` under `root` cannot be read (one line), or None."""
    why, size = file_size(root, rel, what)
    if why is None and end > size:
        why = past_the_end(what, end, rel, size)
    return why
