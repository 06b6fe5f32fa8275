"""Checkpoints in object storage, recognised from one listing (NOTE: [object storage]).

The layouts read from a URL are the ones large jobs write there: DCP directories (fsdpcheck.save
when its manifest is beside ``.metadata``; any other writer's, torchtitan's step folders
included, as plain DCP) and safetensors (a file, an index, a folder of them). Anything else is
refused in one line that says what is supported.
"""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, Part
from fsdpcheck.formats.transformers import safetensors_folder
from fsdpcheck.manifest import MANIFEST_NAME
from fsdpcheck.sources.remote import RemotePath

__all__ = ["describe_remote"]

_METADATA = ".metadata"


def describe_remote(path: RemotePath) -> CheckpointInfo:
    """Recognises the checkpoint at a URL from its listing.

    Raises:
        FileNotFoundError: Nothing is there.
        PermissionError: Listing it is denied.
        ValueError: It is not a checkpoint fsdpcheck reads from object storage.
    """
    path.store.refresh(path.key)
    info = path.info()
    if info is None:
        raise FileNotFoundError(f"checkpoint {path} does not exist (no object, and no objects "
                                "under that prefix)")  # fmt: skip
    if not info.is_dir:
        name = path.name
        if name.endswith(".safetensors.index.json"):
            what = f"a sharded safetensors index ({name})"
            return CheckpointInfo(path, "safetensors", "full", what, [_safetensors(path)])
        if name.endswith(".safetensors"):
            what = f"a safetensors file ({name})"
            return CheckpointInfo(path, "safetensors", "full", what, [_safetensors(path)])
        if name == _METADATA:
            raise ValueError(f"{path} is a DCP .metadata file: pass its folder, {path.parent}")
        raise ValueError(_unsupported(path, "an object"))
    names = path.listing()
    if _METADATA in names:
        if MANIFEST_NAME in names:
            what = f"a DCP checkpoint written by fsdpcheck.save ({path})"
            return CheckpointInfo(path, "fsdpcheck", "sharded", what, [_dcp(path)])
        what = f"a DCP checkpoint directory ({path})"
        return CheckpointInfo(path, "dcp", "sharded", what, [_dcp(path)])
    files = {n for n, i in names.items() if not i.is_dir}
    found = safetensors_folder(
        path, files, "safetensors", "folder of safetensors", readers.remote_safetensors
    )
    if found is not None:
        return found
    raise ValueError(_unsupported(path, "a prefix"))


def _dcp(path: RemotePath) -> Part:
    return Part(path, "any", readers.remote_dcp)


def _safetensors(path: RemotePath) -> Part:
    return Part(path, "any", readers.remote_safetensors)


def _unsupported(path: RemotePath, what: str) -> str:
    return (
        f"{path} is {what} fsdpcheck does not read from object storage: it reads DCP "
        "directories (a prefix holding .metadata) and safetensors (a .safetensors file, a "
        "*.safetensors.index.json, a prefix holding them); copy other layouts to local disk"
    )
