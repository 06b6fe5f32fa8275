"""What a checkpoint path is, recognised from its own structure: one module per layout.

``describe_path`` is what ``open_source``, ``load``, ``audit`` and ``inspect`` all ask. Each
layout module (``fsdpcheck/formats/<layout>.py``) recognises its writer's checkpoints from file
names and small marker files only (never unpickling anything), states its key grammar and
quirks, and names the reader of each part it finds (``Part``; ``formats.readers``). ``LAYOUTS``
is the registry, found rather than kept: every ``CheckpointLayout`` subclass with a ``name``
that a module of this package defines, ordered by its ``rank`` (the first that recognises a
path wins; NOTE: [layout ranks] in ``formats.base`` says which rank a layout takes). Adding a
layout is a new module here and its corpus builder (``tests/corpus/``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from fsdpcheck.formats.accelerate import accelerate_parts
from fsdpcheck.formats.base import (
    DEFAULT_GRAMMAR,
    RANK_BANDS,
    RANK_END,
    CheckpointInfo,
    CheckpointLayout,
    KeyGrammar,
    Part,
    Probe,
    Reader,
    is_dcp_dir,
)
from fsdpcheck.formats.files import TORCH_SAVE_SUFFIXES
from fsdpcheck.formats.remote import describe_remote
from fsdpcheck.sources.remote import RemotePath, location


def discover(modules: Iterable[ModuleType]) -> tuple[CheckpointLayout, ...]:
    """The layouts `modules` define, by rank: each ``CheckpointLayout`` subclass with a name.

    A class counts in the module that defines it (not where it is imported); one without a
    ``name`` is a shared base, not a layout.

    Raises:
        TypeError: A layout declares no rank, or one outside ``RANK_BANDS``; two layouts share
            a rank (which of them comes first would be left to chance) or a name.
    """
    found: list[type[CheckpointLayout]] = []
    for module in modules:
        for _, cls in sorted(inspect.getmembers(module, inspect.isclass)):
            if issubclass(cls, CheckpointLayout) and cls.__module__ == module.__name__ and cls.name:
                found.append(cls)
    bands = "; ".join(f"{start}: {what}" for start, what in RANK_BANDS)
    by_rank: dict[int, type[CheckpointLayout]] = {}
    by_name: dict[str, type[CheckpointLayout]] = {}
    for cls in found:
        rank = cls.rank
        if not isinstance(rank, int) or not RANK_BANDS[0][0] <= rank < RANK_END:
            raise TypeError(
                f"{_named(cls)} has rank {rank!r}: give it a number in its band (NOTE: "
                f"[layout ranks] in fsdpcheck/formats/base.py; {bands})"
            )
        if rank in by_rank:
            raise TypeError(
                f"{_named(cls)} has the rank {rank} of {_named(by_rank[rank])}: which of them "
                "is asked first would be left to chance; give one of them a free number of "
                "the band (NOTE: [layout ranks] in fsdpcheck/formats/base.py)"
            )
        if cls.name in by_name:
            raise TypeError(
                f"{_named(cls)} has the name of {_named(by_name[cls.name])}: a checkpoint's "
                "layout is recorded by name (CheckpointInfo.layout, keys.py's grammar)"
            )
        by_rank[rank], by_name[cls.name] = cls, cls
    return tuple(by_rank[r]() for r in sorted(by_rank))


def _named(cls: type[CheckpointLayout]) -> str:
    return f"layout {cls.name!r} ({cls.__module__}.{cls.__qualname__})"


def package_modules(package: ModuleType) -> list[ModuleType]:
    """Every module of `package`, imported, by name: from its own folder, nothing outside it."""
    found = pkgutil.iter_modules(package.__path__)
    names = sorted(m.name for m in found if m.name != "__main__")  # __main__ would run
    return [importlib.import_module(f"{package.__name__}.{n}") for n in names]


#: Every layout, in the order ``describe_path`` asks them (``rank``: NOTE: [layout ranks]).
LAYOUTS: tuple[CheckpointLayout, ...] = discover(package_modules(sys.modules[__name__]))
_BY_NAME = {layout.name: layout for layout in LAYOUTS}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def layout_named(name: str) -> CheckpointLayout | None:
    """The layout of that name (``CheckpointInfo.layout``), or None."""
    return _BY_NAME.get(name)


def grammar_of(name: str) -> KeyGrammar:
    """The key grammar of a layout (the default one for unknown names)."""
    layout = _BY_NAME.get(name)
    return layout.grammar if layout is not None else DEFAULT_GRAMMAR


def describe_path(path: str | os.PathLike[str] | RemotePath) -> CheckpointInfo:
    """Recognises a checkpoint's layout from its structure.

    A URL (``s3://``, ``gs://``, ``az://``, ``hf://``, any fsspec knows) is recognised from its
    listing (``formats.remote``); ``file://`` is a local path.

    Raises:
        FileNotFoundError: The path does not exist.
        PermissionError: A folder on its path may not be searched.
        ValueError: It is not a checkpoint fsdpcheck recognises (the message says what it holds).
    """
    if not isinstance(path, os.PathLike) and (not isinstance(path, str) or _URL.match(path)):
        where = location(path)  # NOTE: [object storage] in sources/remote.py
        if isinstance(where, RemotePath):
            return describe_remote(where)
        path = where  # file://: a local path
    p = Path(path)  # type: ignore[arg-type]  # what location() leaves is a local path
    try:
        st = os.stat(p)
    except FileNotFoundError:
        where = "" if p.is_absolute() else f"looked for {p.absolute()}; "
        raise FileNotFoundError(
            f"checkpoint {p} does not exist ({where}give the path of a checkpoint directory or "
            "file)"
        ) from None
    except PermissionError:
        raise PermissionError(
            f"checkpoint {p}: permission denied (a folder on its path may not be searched)"
        ) from None
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"checkpoint {p} is not a regular file or a directory; refusing it")
    probe = Probe(p, st, describe_path)
    for layout in LAYOUTS:
        info = layout.recognize(probe)
        if info is not None:
            return info
    if not probe.is_dir:
        raise ValueError(
            f"{p} is not a checkpoint fsdpcheck recognises (expected a DCP directory, a torch.save "
            f"file {'/'.join(TORCH_SAVE_SUFFIXES)}, .safetensors, *.safetensors.index.json or "
            "*.bin.index.json)"
        )
    saved = sorted(
        n for n in probe.names if Path(n).suffix in TORCH_SAVE_SUFFIXES and (p / n).is_file()
    )
    if len(saved) == 1:  # a folder holding one torch.save file stands for that file
        info = describe_path(p / saved[0])
        info.path = p
        return info
    if not probe.names:
        raise ValueError(
            f"{p} is an empty directory, not a checkpoint (was the save finished, or is the path "
            "one level off?)"
        )
    raise ValueError(
        f"{p} holds no checkpoint fsdpcheck recognises: no DCP .metadata, no safetensors, and "
        f"{len(saved)} torch.save files (pass one file, or a DCP directory)"
    )


__all__ = [
    "LAYOUTS",
    "TORCH_SAVE_SUFFIXES",
    "CheckpointInfo",
    "CheckpointLayout",
    "KeyGrammar",
    "Part",
    "Reader",
    "accelerate_parts",
    "describe_path",
    "discover",
    "grammar_of",
    "is_dcp_dir",
    "layout_named",
    "package_modules",
]
