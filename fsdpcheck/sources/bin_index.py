"""Sharded torch.save checkpoints: ``pytorch_model-0000x-of-0000y.bin`` + ``*.bin.index.json``.

What ``save_pretrained(..., safe_serialization=False)`` wrote (and most older hub models hold),
accelerate's ``save_model(..., safe_serialization=False)``, huggingface_hub's
``save_torch_state_dict(..., safe_serialization=False)`` and DeepSpeed's ``zero_to_fp32`` without
safetensors. The index has the same form as a ``*.safetensors.index.json`` (``weight_map``: tensor
name -> shard file name) and is read the same way: the index is the authority.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Entry, Problem, Region, Source
from fsdpcheck.sources.fileio import file_problem
from fsdpcheck.sources.index_json import read_index
from fsdpcheck.sources.torch_save import TorchSaveSource

INDEX_SUFFIX = ".bin.index.json"


def is_bin_index(path: Path) -> bool:
    """Whether `path` names a ``*.bin.index.json`` (what `BinIndexSource` opens)."""
    return path.name.endswith(INDEX_SUFFIX)


class BinIndexSource(Source):
    """The torch.save shards a ``*.bin.index.json`` names, each loaded weights-only when read.

    The index is the authority: every ``weight_map`` entry must name a regular file inside the
    index's folder (`file_problem`) that holds that tensor; reads go to that file only. Entries
    that fail are left out of `entries` and listed by `problems`, as are tensors a shard holds
    that the index does not list (or lists in another shard), shards that cannot be loaded
    (truncated, not torch.save, refused by the weights-only unpickler) and what
    `TorchSaveSource` refuses inside a shard.

    Bounded: opening loads each shard once (mapped, ``weights_only``: only its pickled layout is
    read) to learn its tensors, then drops it; a read loads the shards it needs again and drops
    them after. torch's mapped load keeps no file descriptor, so a checkpoint of thousands of
    shards never holds more than the mappings of the tensors being read.
    """

    kind = "torch.save"

    def __init__(self, index: str | os.PathLike[str]) -> None:
        self.path = Path(index)
        self.description = f"torch.save index {self.path}"
        weight_map = read_index(self.path, "torch.save index")
        root = self.path.parent
        self._root = root
        self._problems: list[Problem] = []
        self._entries: dict[str, Entry] = {}
        self._file_of: dict[str, str] = {}
        named: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            named.setdefault(name, []).append(key)
        for name, keys in sorted(named.items()):
            shard, why = None, file_problem(root, name, 0, f"index entry {name!r}")
            if why is None:
                try:
                    shard = TorchSaveSource(root / name)
                except (CheckpointError, FileNotFoundError) as exc:
                    why = str(exc)
            if shard is None:
                self._problems += [(k, "error", f"{self.description}: {why}") for k in keys]
                continue
            self._take(shard, name, keys, weight_map)

    def _take(
        self, shard: TorchSaveSource, name: str, keys: list[str], weight_map: dict[str, str]
    ) -> None:
        """Enters the index's keys that `shard` (file `name`) holds; the rest are problems."""
        held = shard.entries()
        refused = {k: msg for k, _, msg in shard.problems()}
        for key in keys:
            entry = held.get(key)
            if entry is None or not entry.is_tensor:
                msg = f"{self.description} names {name} for {key}, but {name} has no such tensor"
                self._problems.append((key, "error", msg))
            elif key in refused:
                self._problems.append((key, "error", refused[key]))
            else:
                self._entries[key] = entry
                self._file_of[key] = name
        for key in sorted(held.keys() - set(keys)):
            other = weight_map.get(key)
            if other is None:
                msg = f"{name} holds {key}, which {self.description} does not list (not read)"
            else:
                msg = (
                    f"a stray copy of {key} is in {name}; {self.description} names {other}, "
                    "which is what is read"
                )
            self._problems.append((key, "error", msg))

    def entries(self) -> dict[str, Entry]:
        """Every tensor the index lists and its shard holds."""
        return self._entries

    def problems(self) -> list[Problem]:
        """Index entries that fail, unreadable shards, unlisted or stray tensors."""
        return list(self._problems)

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each shard the regions need, loaded, read as `TorchSaveSource` reads, and dropped.

        Raises:
            CheckpointError: A shard can no longer be loaded, or no longer holds the tensor
                (shape and dtype) it held when the index was opened.
        """
        by_file: dict[str, list[int]] = {}
        for i, r in enumerate(regions):
            by_file.setdefault(self._file_of[r.key], []).append(i)
        result: dict[int, torch.Tensor] = {}
        for name, at in by_file.items():
            try:
                shard = TorchSaveSource(self._root / name)
            except FileNotFoundError as exc:
                raise CheckpointError(f"{self.description}: {exc}") from None
            held = shard.entries()
            for i in at:
                key = regions[i].key
                now, then = held.get(key), self._entries[key]
                if now is None or (now.shape, now.dtype) != (then.shape, then.dtype):
                    raise CheckpointError(
                        f"{self.description}: {name} changed since it was opened: {key} is "
                        f"no longer {tuple(then.shape)} {then.dtype}; refusing to read it"
                    )
            mine = [out[i] for i in at] if out is not None else None
            for i, t in zip(at, shard.read([regions[i] for i in at], device, mine)):
                result[i] = t
            del shard  # its mapping lives on only in the views just returned
        return [result[i] for i in range(len(regions))]
