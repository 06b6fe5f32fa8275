"""accelerate ``save_state`` directories.

Under FSDP: ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/`` (DCP directories, keys
``model.<fqn>`` and ``optimizer.state.<fqn>.<name>``), or full ``pytorch_model_fsdp.bin`` and
``optimizer.bin``; without FSDP (and with a silently ignored FSDP plugin on the CPU):
``model.safetensors`` + ``optimizer.bin``. ``random_states_*.pkl``, ``scheduler.bin`` and
``scaler.pt`` are training state.
"""

from __future__ import annotations

import re
from pathlib import Path

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import (
    CheckpointInfo,
    CheckpointLayout,
    Part,
    Probe,
    is_dcp_dir,
    training_note,
)

_MARKERS = re.compile(
    r"(random_states_\d+\.pkl|optimizer(_\d+)?(\.bin)?|scheduler(_\d+)?\.bin|"
    r"pytorch_model_fsdp(_\d+)?(\.bin)?)"
)
_TRAINING = re.compile(r"(random_states_\d+\.pkl|scheduler(_\d+)?\.bin|scaler\.pt)")


def accelerate_parts(path: Path, index: int = 0) -> tuple[Path | None, Path | None]:
    """(model, optimizer) checkpoint of model/optimizer `index` in a save_state directory."""
    s = "" if index == 0 else f"_{index}"
    models = (
        f"pytorch_model_fsdp_{index}",
        f"pytorch_model_fsdp{s}.bin",
        f"model{s}.safetensors",
        f"pytorch_model{s}.bin",
    )
    optims = (f"optimizer_{index}", f"optimizer_{index}.bin", f"optimizer{s}.bin")

    def first(names: tuple[str, ...]) -> Path | None:
        for n in names:
            q = path / n
            if is_dcp_dir(q) or q.is_file():
                return q
        return None

    return first(models), first(optims)


class Accelerate(CheckpointLayout):
    """An accelerate ``save_state`` directory."""

    name = "accelerate"
    # NOTE: [layout ranks] After hf-trainer (330), whose FSDP folders hold pytorch_model_fsdp_0/
    # and optimizer_0/ too.
    rank = 340

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A directory holding accelerate's model, optimizer or RNG-state files."""
        if not probe.is_dir or probe.is_dcp or not any(_MARKERS.fullmatch(n) for n in probe.names):
            return None
        p = probe.path
        model, optim = accelerate_parts(p)
        if model is None:
            raise ValueError(
                f"{p} looks like an accelerate save_state directory but holds no model "
                "checkpoint (pytorch_model_fsdp_0/, model.safetensors, ...)"
            )
        kind = "sharded" if is_dcp_dir(model) else "full"
        files = [model] + ([optim] if optim is not None else [])
        roles = ["model"] + (["optimizer"] if optim is not None else [])
        parts = [Part(q, role, readers.by_name(q)) for q, role in zip(files, roles)]
        what = ", ".join(q.name + ("/" if q.is_dir() else "") for q in files)
        training = sorted(p / n for n in probe.names if _TRAINING.fullmatch(n))
        return CheckpointInfo(
            p,
            self.name,
            kind,
            f"an accelerate save_state directory ({kind}: {what})",
            parts,
            training_note(training),
            training,
        )
