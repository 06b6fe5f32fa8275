"""What a checkpoint path is, recognised from its own structure: one module per layout.

``describe_path`` is what ``open_source``, ``load``, ``audit`` and ``inspect`` all ask. Each
layout module (``fsdpcheck/formats/<layout>.py``) recognises its writer's checkpoints from file
names and small marker files only (never unpickling anything) and states its key grammar and
quirks, and names the reader of each part it finds (``Part``; ``formats.readers``); ``LAYOUTS``
is the ordered registry (first match wins: the more specific layouts come first). Adding a
layout is a new module here, one line in ``LAYOUTS``, and its corpus builder (``tests/corpus/``).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.formats.accelerate import Accelerate, accelerate_parts
from fsdpcheck.formats.base import (
    DEFAULT_GRAMMAR,
    CheckpointInfo,
    CheckpointLayout,
    KeyGrammar,
    Part,
    Probe,
    Reader,
    is_dcp_dir,
)
from fsdpcheck.formats.dcp import Dcp
from fsdpcheck.formats.deepspeed import DeepSpeed
from fsdpcheck.formats.ds_universal import DeepSpeedUniversal
from fsdpcheck.formats.files import TORCH_SAVE_SUFFIXES, Safetensors, TorchSave
from fsdpcheck.formats.hf_storage import HFStorage
from fsdpcheck.formats.lightning import Lightning
from fsdpcheck.formats.megatron import Megatron
from fsdpcheck.formats.native import Native
from fsdpcheck.formats.peft import Peft
from fsdpcheck.formats.torchtitan import Torchtitan
from fsdpcheck.formats.transformers import HuggingFace, TrainerCheckpoint

if TYPE_CHECKING:
    from fsdpcheck.sources.remote import RemotePath

#: Every layout, in order of priority (the first that recognises a path describes it).
LAYOUTS: tuple[CheckpointLayout, ...] = (
    Native(),
    Megatron(),
    Lightning(),
    Torchtitan(),
    Dcp(),
    DeepSpeedUniversal(),
    DeepSpeed(),
    TrainerCheckpoint(),
    Accelerate(),
    Peft(),
    HFStorage(),
    HuggingFace(),
    Safetensors(),
    TorchSave(),
)
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
        from fsdpcheck.sources.remote import RemotePath, location

        where = location(path)  # NOTE: [object storage] in sources/remote.py
        if isinstance(where, RemotePath):
            from fsdpcheck.formats.remote import describe_remote

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
    probe = Probe(p, st)
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
    "grammar_of",
    "is_dcp_dir",
    "layout_named",
]
