"""The readers a layout names for its parts: one per storage kind under ``fsdpcheck/sources/``.

A layout knows what each of its parts is when it recognises it (a DCP folder, a safetensors
file, torch.save shards behind an index), so it names the reader there (``Part.reader``) and
opening a part is ``part.reader(part.path)``. A storage kind that only one layout writes keeps
its reader in that layout's module (``formats.hf_storage``, ``formats.ds_universal``), which
also takes the kind's file-name rules from its source module: the formats import the sources,
never the other way round (``fsdpcheck.reading.references.open_source``, above both, imports
``describe_path``).

NOTE: [readers import lazily] Each reader here imports its ``Source`` when called: recognising
a path must not pull in torch.distributed.checkpoint (about a second of start-up), which a
safetensors compare or ``fsdpcheck inspect`` of a file never needs, nor the readers of kinds it
does not hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdpcheck.formats.base import Reader
    from fsdpcheck.sources.base import Source
    from fsdpcheck.sources.dcp.source import Verdicts
    from fsdpcheck.sources.remote import RemotePath

__all__ = [
    "bin_index",
    "by_name",
    "dcp",
    "remote_dcp",
    "remote_safetensors",
    "safetensors",
    "torch_save",
]

#: Index files of sharded checkpoints: safetensors, and torch.save shards (``pytorch_model-0000x-
#: of-0000y.bin``, written by ``save_pretrained(safe_serialization=False)`` in older transformers,
#: accelerate's ``save_model(safe_serialization=False)`` and ``zero_to_fp32`` without safetensors).
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
BIN_INDEX_SUFFIX = ".bin.index.json"


def dcp(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A DCP directory (`trust`: the verdicts of another process's check of its .metadata)."""
    from fsdpcheck.sources.dcp.source import DCPSource

    return DCPSource(path, verdicts=trust)


def safetensors(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A ``.safetensors`` file or a ``*.safetensors.index.json``."""
    del trust
    from fsdpcheck.sources.safetensors_files import SafetensorsSource

    return SafetensorsSource.from_path(path)  # type: ignore[arg-type]  # a local path


def torch_save(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A torch.save file, loaded weights-only."""
    del trust
    from fsdpcheck.sources.torch_save import TorchSaveSource

    return TorchSaveSource(path)  # type: ignore[arg-type]  # a local path


def bin_index(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A ``*.bin.index.json`` and the torch.save shards it names."""
    del trust
    from fsdpcheck.sources.bin_index import BinIndexSource

    return BinIndexSource(path)  # type: ignore[arg-type]  # a local path


def remote_dcp(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A DCP directory in an object store."""
    from fsdpcheck.sources.dcp.remote import RemoteDCPSource

    return RemoteDCPSource(path, verdicts=trust)  # type: ignore[arg-type]  # a RemotePath


def remote_safetensors(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A ``.safetensors`` file or a ``*.safetensors.index.json`` in an object store."""
    del trust
    from fsdpcheck.sources.remote_files import RemoteSafetensorsSource

    return RemoteSafetensorsSource.from_remote(path)  # type: ignore[arg-type]  # a RemotePath


def by_name(path: Path) -> Reader:
    """The reader of a file or DCP folder that a layout found under one of its own names.

    For the layouts whose writers put the same role under several names (the Trainer's
    ``model.safetensors`` or ``pytorch_model.bin``, accelerate's ``optimizer_0/`` or
    ``optimizer.bin``): a directory is a DCP folder (the layouts only take DCP folders), a
    ``*.bin.index.json`` names torch.save shards, a ``.safetensors`` file or index is
    safetensors, anything else a torch.save file.
    """
    if path.name.endswith(BIN_INDEX_SUFFIX):
        return bin_index
    if path.is_dir():
        return dcp
    if path.suffix == ".safetensors" or path.name.endswith(SAFETENSORS_INDEX_SUFFIX):
        return safetensors
    return torch_save
