"""torchtitan ``CheckpointManager``: ``step-N/`` DCP folders.

Each step folder holds the model's flat FQN keys, ``optimizer`` as flattened
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<name>``, and ``lr_scheduler``, ``dataloader``
and ``train_state`` (training state, named, not compared).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import (
    CheckpointInfo,
    CheckpointLayout,
    Part,
    Probe,
    is_dcp_dir,
    listdir,
)

STEP = re.compile(r"step-(\d+)")
#: What marks a step folder complete, as torchtitan's ``CheckpointManager`` tests it when it
#: looks for the step to load: DCP's ``.metadata``, or the index of a save in Hugging Face
#: format.
_COMPLETE = (".metadata", "model.safetensors.index.json")


def step_of(path: Path) -> int | None:
    """N of a ``step-N`` folder, or None for any other name."""
    m = STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def step_folders(root: Path, holds: Callable[[Path], bool] | None = None) -> list[Path]:
    """The ``step-N`` folders of a torchtitan checkpoint folder that hold a checkpoint, by N.

    Args:
        root: ``CheckpointManager.folder``.
        holds: Whether a step folder holds a checkpoint (default: torchtitan's own test, a
            ``.metadata`` or a ``model.safetensors.index.json`` file inside).

    Raises:
        ValueError: `root` cannot be listed.
    """
    test = holds if holds is not None else _complete
    found = [(n, q) for q in listdir(root) if (n := step_of(q)) is not None and test(q)]
    return [q for _, q in sorted(found, key=lambda f: f[0])]


def latest_step_folder(folder: str | os.PathLike[str]) -> Path | None:
    """The ``step-N`` folder with the largest N holding a checkpoint (as torchtitan picks it)."""
    root = Path(folder)
    if not root.is_dir():
        return None
    steps = step_folders(root)
    return steps[-1] if steps else None


def _complete(q: Path) -> bool:
    return any((q / name).is_file() for name in _COMPLETE)


class Torchtitan(CheckpointLayout):
    """A ``step-N`` DCP folder; its parent folder (several steps) is refused with a hint."""

    name = "torchtitan"
    # NOTE: [layout ranks] The step-N name marks a DCP directory (band 100); after the layouts
    # marked by a file, which a step folder of theirs keeps.
    rank = 140

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A DCP directory named ``step-N``; a folder of them raises with the one to pass."""
        p = probe.path
        if probe.is_dcp:
            if step_of(p) is None:
                return None
            what = f"a torchtitan step folder ({p})"
            return CheckpointInfo(p, self.name, "sharded", what, [Part(p, "any", readers.dcp)])
        if not probe.is_dir or not any(STEP.fullmatch(n) for n in probe.names):
            return None
        steps = step_folders(p, is_dcp_dir)
        if not steps:
            return None
        raise ValueError(
            f"{p} is a torchtitan checkpoint folder with {len(steps)} step(s); pass one of them, "
            f"e.g. {steps[-1]}"
        )
