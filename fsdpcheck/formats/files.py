"""Single files and plain folders: safetensors, torch.save."""

from __future__ import annotations

from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, KeyGrammar, Probe
from fsdpcheck.formats.transformers import safetensors_folder

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class Safetensors(CheckpointLayout):
    """A ``.safetensors`` file, a ``*.safetensors.index.json``, or a folder of them."""

    name = "safetensors"
    grammar = KeyGrammar(flat_names=True)

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """By suffix (files) or by the files a folder holds."""
        p = probe.path
        if probe.is_dir:
            if probe.is_dcp:
                return None
            return safetensors_folder(p, probe.names, self.name, "folder of safetensors")
        if p.name.endswith(".safetensors.index.json"):
            return CheckpointInfo(
                p, self.name, "full", f"a sharded safetensors index ({p.name})", [p]
            )
        if p.suffix == ".safetensors":
            return CheckpointInfo(p, self.name, "full", f"a safetensors file ({p.name})", [p])
        return None


class TorchSave(CheckpointLayout):
    """A ``torch.save`` file (``.pt``, ``.pth``, ``.bin``)."""

    name = "torch.save"

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """By suffix."""
        p = probe.path
        if probe.is_dir or p.suffix not in TORCH_SAVE_SUFFIXES:
            return None
        return CheckpointInfo(p, self.name, "full", f"a torch.save file ({p.name})", [p])
