"""torch's ``HuggingFaceStorageWriter``: per-rank safetensors shards placed by header metadata.

``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`` has
every rank write ``shard-<rank + 1>-model-<i>-of-<n>.safetensors`` into `path`; with
``enable_consolidation=True`` the shards go to ``path/sharded/`` and the full tensors
(``model-*.safetensors`` + ``model.safetensors.index.json``) to `path`. The reader is
``fsdpcheck.sources.hf_storage``. Kind "full": ``load`` reads each tensor whole (assembled from
its boxes) and every rank keeps its part.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe
from fsdpcheck.sources.hf_storage import SHARD_NAME, HFStorageSource, shard_files

if TYPE_CHECKING:
    from fsdpcheck.sources.base import Source
    from fsdpcheck.sources.dcp.source import Verdicts
    from fsdpcheck.sources.remote import RemotePath

__all__ = ["SHARDED_DIR", "SHARD_NAME", "HFStorage", "read_shards", "shard_files"]

SHARDED_DIR = "sharded"


def read_shards(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """The reader of this layout's parts: a shard file, or a folder of them, read as one."""
    del trust
    return HFStorageSource(path)  # type: ignore[arg-type]  # a local path


def _shards(path: Path) -> list[Part]:
    return [Part(path, "any", read_shards)]


def _describe(folder: Path, shards: list[Path]) -> str:
    return (
        f"per-rank safetensors shards from torch's HuggingFaceStorageWriter ({len(shards)} "
        f"file(s) in {folder})"
    )


class HFStorage(CheckpointLayout):
    """A folder of per-rank shards, one shard file, or a consolidated folder with ``sharded/``."""

    name = "hf_storage"
    # NOTE: [layout ranks] Its shard names are its own (band 300); a folder of them is also a
    # folder of safetensors (band 500).
    rank = 360

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """Shards by name; a consolidated folder is read through its index (with a note)."""
        path = probe.path
        if not probe.is_dir:
            if not SHARD_NAME.fullmatch(path.name):
                return None
            others = len(shard_files(path.parent)) - 1
            notes = []
            if others:
                notes.append(
                    f"{others} other shard file(s) beside it not read (pass {path.parent})"
                )
            what = (
                f"one rank's safetensors shard from torch's HuggingFaceStorageWriter ({path.name})"
            )
            return CheckpointInfo(path, self.name, "full", what, _shards(path), notes)
        if probe.is_dcp:
            return None
        shards = shard_files(path)
        index = sorted(n for n in probe.names if n.endswith(".safetensors.index.json"))
        if shards and not index:
            return CheckpointInfo(path, self.name, "full", _describe(path, shards), _shards(path))
        sharded = path / SHARDED_DIR
        shards = shard_files(sharded) if sharded.is_dir() else []
        if not shards:
            return None
        if len(index) == 1:
            info = probe.describe(path / index[0])  # as describe_path recognises it
            info.path = path
            info.notes.append(
                f"{SHARDED_DIR}/ holds the per-rank shards these consolidated files were made "
                f"from: not read (pass {sharded} to check them)"
            )
            return info
        if index:
            return None  # several indexes: the safetensors folder rules refuse it with one line
        note = (
            f"no model.safetensors.index.json beside {SHARDED_DIR}/ (consolidation not run or "
            "not finished): the per-rank shards are read"
        )
        return CheckpointInfo(
            path, self.name, "full", _describe(sharded, shards), _shards(sharded), [note]
        )
