"""PEFT adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``).

An adapter file holds only the adapter's weights, named as the live PEFT model names them with
the adapter's name removed (``...lora_A.weight`` for the live ``...lora_A.default.weight``);
the frozen base weights are not in it. The pairing (``matching``) puts the adapter name back
and names the base weights as not in an adapter file.
"""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe

_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class Peft(CheckpointLayout):
    """A PEFT ``save_pretrained`` folder, or its adapter file."""

    name = "peft"
    # NOTE: [layout ranks] After hf-trainer (330): a Trainer folder of a PEFT model holds
    # adapter_config.json too.
    rank = 350

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A folder with ``adapter_config.json`` and an adapter file, or that file."""
        p = probe.path
        if not probe.is_dir:
            if p.name in _FILES and (p.parent / "adapter_config.json").is_file():
                what = f"a PEFT adapter ({p.name})"
                part = Part(p, "adapter", readers.by_name(p))
                return CheckpointInfo(p, self.name, "full", what, [part])
            return None
        if probe.is_dcp or not probe.has_file("adapter_config.json"):
            return None
        for name in _FILES:
            if probe.has_file(name):
                part = Part(p / name, "adapter", readers.by_name(p / name))
                return CheckpointInfo(
                    p, self.name, "full", f"a PEFT adapter folder ({name})", [part]
                )
        raise ValueError(f"{p} holds adapter_config.json but no {' or '.join(_FILES)}")
