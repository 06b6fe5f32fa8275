"""DeepSpeed ``save_checkpoint``: ``latest`` + ``<tag>/`` with model and ZeRO optimizer states.

ZeRO-1/2: ``mp_rank_00_model_states.pt`` holds the full module state dict. ZeRO-3:
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` holds EMPTY placeholders (shape (0,)) for the
partitioned parameters; their values live in the flattened ZeRO optimizer partitions, which
cannot be mapped to parameters without DeepSpeed's own consolidation (``zero_to_fp32.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe
from fsdpcheck.sources.ds_universal import is_model_states

__all__ = ["DeepSpeed", "is_model_states"]


class DeepSpeed(CheckpointLayout):
    """A DeepSpeed checkpoint folder (or its tag folder, or one model-states file)."""

    name = "deepspeed"
    # NOTE: [layout ranks] After deepspeed_universal (310); before hf-trainer (330), so a
    # Trainer folder saved under DeepSpeed (its latest file) is read as DeepSpeed's.
    rank = 320

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """``latest`` or ``*mp_rank_*_model_states.pt`` in a folder, or such a file."""
        p = probe.path
        if not probe.is_dir:
            return self._info(p.parent, p.parent) if is_model_states(p.name) else None
        if probe.is_dcp:
            return None
        if "latest" in probe.names:
            return self._info(p, _tag(p))
        if any(is_model_states(n) for n in probe.names):
            return self._info(p, p)
        return None

    def placeholder(self, info: CheckpointInfo, shape: tuple[int, ...]) -> str | None:
        """ZeRO-3 model states hold a (0,) stand-in for every partitioned parameter."""
        zero3 = bool(info.parts) and info.parts[0].path.name.startswith("zero_pp_rank_")
        if zero3 and len(shape) > 0 and math.prod(shape) == 0:
            return (
                f"an empty placeholder {shape}: DeepSpeed ZeRO-3 keeps the values in its "
                "optimizer partitions (consolidate with zero_to_fp32.py and check that)"
            )
        return None

    def _info(self, p: Path, folder: Path) -> CheckpointInfo:
        # The plain name first: ZeRO-1/2's single file holds the full module weights.
        states = sorted(
            (q for q in folder.iterdir() if is_model_states(q.name)),
            key=lambda q: (not q.name.startswith("mp_rank_"), q.name),
        )
        if not states:
            raise ValueError(f"{folder} holds no DeepSpeed *mp_rank_*_model_states.pt")
        zero = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))
        notes = []
        if zero:
            notes.append(
                f"{len(zero)} ZeRO optimizer partition file(s) hold flattened state that "
                "cannot be mapped to parameters; not read"
            )
        if len(states) > 1:
            notes.append(f"{len(states)} model-parallel ranks: only {states[0].name} is read")
        return CheckpointInfo(
            p,
            self.name,
            "full",
            f"a DeepSpeed checkpoint ({folder.name}/{states[0].name})",
            [Part(states[0], "any", readers.torch_save)],
            notes,
        )


def _tag(p: Path) -> Path:
    tag = (p / "latest").read_text().strip() if (p / "latest").is_file() else ""
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise ValueError(f"{p / 'latest'} does not name a checkpoint folder inside {p}")
    return p / tag
