"""Hugging Face: ``save_pretrained`` folders and ``Trainer`` ``checkpoint-N`` folders.

A model folder holds ``config.json`` and the weights: ``model.safetensors``, or shards with a
``model.safetensors.index.json`` (``pytorch_model.bin`` / ``pytorch_model.bin.index.json`` in
older saves). A Trainer checkpoint folder adds ``trainer_state.json`` (its marker) and the
optimizer: ``optimizer.pt`` (a raw ``optimizer.state_dict()``, keyed by integer ids in
param_groups order) or, under FSDP, ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (DCP);
``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin`` and ``scaler.pt`` are training state.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import (
    CheckpointInfo,
    CheckpointLayout,
    Part,
    Probe,
    Reader,
    is_dcp_dir,
    training_note,
)
from fsdpcheck.formats.readers import BIN_INDEX_SUFFIX, SAFETENSORS_INDEX_SUFFIX

if TYPE_CHECKING:
    from fsdpcheck.sources.remote import RemotePath

#: Where the Trainer keeps the model, in order of preference (FSDP's DCP folder first).
MODEL_FILES = (
    "pytorch_model_fsdp_0",
    "model.safetensors.index.json",
    "model.safetensors",
    "adapter_model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    "adapter_model.bin",
)
#: Where the Trainer keeps the optimizer.
OPTIMIZER_FILES = ("optimizer_0", "optimizer.pt", "optimizer.bin")
_TRAINING = re.compile(
    r"(trainer_state\.json|training_args\.bin|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth)"
)


def trainer_files(folder: Path, optimizer: bool = True) -> list[Path]:
    """The model (and optimizer) files of a Trainer ``checkpoint-N`` folder, model first.

    Raises:
        FileNotFoundError: The folder holds no model checkpoint the Trainer writes.
    """
    model = _first(folder, MODEL_FILES)
    if model is None:
        raise FileNotFoundError(f"{folder} holds no model checkpoint ({', '.join(MODEL_FILES)})")
    optim = _first(folder, OPTIMIZER_FILES) if optimizer else None
    return [model] + ([optim] if optim is not None else [])


def trainer_parts(files: list[Path]) -> list[Part]:
    """The parts of `trainer_files`: each with its role and its reader."""
    model, *optim = files
    role = "adapter" if model.name.startswith("adapter_") else "model"
    return [Part(model, role, readers.by_name(model))] + [
        Part(q, "optimizer", readers.by_name(q)) for q in optim
    ]


def _first(folder: Path, names: tuple[str, ...]) -> Path | None:
    for n in names:
        q = folder / n
        if is_dcp_dir(q) or q.is_file():
            return q
    return None


class TrainerCheckpoint(CheckpointLayout):
    """A ``transformers.Trainer`` ``checkpoint-N`` folder (``trainer_state.json`` inside)."""

    name = "hf-trainer"
    # NOTE: [layout ranks] trainer_state.json marks it (band 300); before accelerate and peft,
    # whose files a Trainer folder holds (FSDP's pytorch_model_fsdp_0/, a PEFT adapter).
    rank = 330

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A directory with ``trainer_state.json`` and the Trainer's model files."""
        if not probe.is_dir or probe.is_dcp or not probe.has_file("trainer_state.json"):
            return None
        p = probe.path
        files = trainer_files(p)
        parts = trainer_parts(files)
        kind = "sharded" if is_dcp_dir(files[0]) else "full"
        training = sorted(p / n for n in probe.names if _TRAINING.fullmatch(n))
        what = ", ".join(q.name + ("/" if q.is_dir() else "") for q in files)
        return CheckpointInfo(
            p,
            self.name,
            kind,
            f"a Hugging Face Trainer checkpoint ({what})",
            parts,
            training_note(training),
            training,
        )


class HuggingFace(CheckpointLayout):
    """A ``save_pretrained`` folder, or a sharded safetensors index, with ``config.json``."""

    name = "transformers"
    # NOTE: [layout ranks] Standard weights beside config.json (band 400).
    rank = 410

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """``config.json`` beside safetensors weights (a file, shards, or an index)."""
        p = probe.path
        if not probe.is_dir:
            if p.name.endswith(INDEX_SUFFIXES) and (p.parent / "config.json").is_file():
                safe = p.name.endswith(SAFETENSORS_INDEX_SUFFIX)
                what = "safetensors" if safe else "torch.save"
                reader = readers.safetensors if safe else readers.bin_index
                return CheckpointInfo(
                    p,
                    self.name,
                    "full",
                    f"a sharded {what} index ({p.name})",
                    [Part(p, "model", reader)],
                )
            return None
        if probe.is_dcp or "config.json" not in probe.names:
            return None
        return safetensors_folder(p, probe.names, self.name, "Hugging Face folder") or (
            bin_index_folder(p, probe.names, self.name, "Hugging Face folder, sharded")
        )


#: Index files of sharded checkpoints (``formats.readers``: what each names).
INDEX_SUFFIXES = (SAFETENSORS_INDEX_SUFFIX, BIN_INDEX_SUFFIX)


def bin_index_folder(p: Path, names: set[str], layout: str, what: str) -> CheckpointInfo | None:
    """A folder read through its one ``*.bin.index.json``, or None (two: a ValueError)."""
    found = sorted(n for n in names if n.endswith(BIN_INDEX_SUFFIX))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"{p} holds {len(found)} torch.save indexes ({', '.join(found)}); pass the one to use"
        )
    info = f"a {what} ({found[0]})"
    return CheckpointInfo(p, layout, "full", info, [Part(p / found[0], "model", readers.bin_index)])


def safetensors_folder(
    p: Path | RemotePath,
    names: set[str],
    layout: str,
    what: str,
    reader: Reader = readers.safetensors,
) -> CheckpointInfo | None:
    """A folder of safetensors files (through its index when it has one), or None.

    `reader`: the safetensors reader (``readers.remote_safetensors`` for a prefix in an object
    store).
    """
    index = sorted(n for n in names if n.endswith(SAFETENSORS_INDEX_SUFFIX))
    tensors = sorted(n for n in names if n.endswith(".safetensors"))
    if index:
        if len(index) > 1:
            raise ValueError(
                f"{p} holds {len(index)} safetensors indexes ({', '.join(index)}); pass the one "
                "to use"
            )
        what = f"a {what}, sharded ({index[0]})"
        return CheckpointInfo(p, layout, "full", what, [Part(p / index[0], "model", reader)])
    if not tensors:
        return None
    return CheckpointInfo(
        p,
        layout,
        "full",
        f"a {what} ({', '.join(tensors[:3])}{', ...' if len(tensors) > 3 else ''})",
        [Part(p / t, "model", reader) for t in tensors],
    )
