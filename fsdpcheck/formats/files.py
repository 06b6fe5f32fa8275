"""Single files and plain folders: safetensors, torch.save."""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe
from fsdpcheck.formats.readers import BIN_INDEX_SUFFIX, SAFETENSORS_INDEX_SUFFIX
from fsdpcheck.formats.transformers import bin_index_folder, safetensors_folder

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class Safetensors(CheckpointLayout):
    """A ``.safetensors`` file, a ``*.safetensors.index.json``, or a folder of them."""

    name = "safetensors"
    # NOTE: [layout ranks] By suffix, or the files a folder holds (band 500); before torch.save,
    # so a folder holding both kinds is read as safetensors.
    rank = 510

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """By suffix (files) or by the files a folder holds."""
        p = probe.path
        if probe.is_dir:
            if probe.is_dcp:
                return None
            return safetensors_folder(p, probe.names, self.name, "folder of safetensors")
        part = [Part(p, "any", readers.safetensors)]
        if p.name.endswith(SAFETENSORS_INDEX_SUFFIX):
            return CheckpointInfo(
                p, self.name, "full", f"a sharded safetensors index ({p.name})", part
            )
        if p.suffix == ".safetensors":
            return CheckpointInfo(p, self.name, "full", f"a safetensors file ({p.name})", part)
        return None


class TorchSave(CheckpointLayout):
    """A ``torch.save`` file (``.pt``, ``.pth``, ``.bin``), or shards with their index."""

    name = "torch.save"
    # NOTE: [layout ranks] Last: by suffix, or a folder's one *.bin.index.json (band 500).
    rank = 520

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """By suffix; a folder holding one ``*.bin.index.json`` is read through it."""
        p = probe.path
        if probe.is_dir:
            if probe.is_dcp:
                return None
            return bin_index_folder(p, probe.names, self.name, "sharded torch.save checkpoint")
        if p.name.endswith(BIN_INDEX_SUFFIX):
            what = f"a sharded torch.save checkpoint ({p.name})"
            return CheckpointInfo(p, self.name, "full", what, [Part(p, "model", readers.bin_index)])
        if p.suffix not in TORCH_SAVE_SUFFIXES:
            return None
        what = f"a torch.save file ({p.name})"
        return CheckpointInfo(p, self.name, "full", what, [Part(p, "any", readers.torch_save)])
