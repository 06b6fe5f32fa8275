"""torchtitan ``CheckpointManager``: ``step-N/`` DCP folders.

Each step folder holds the model's flat FQN keys, ``optimizer`` as flattened
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<name>``, and ``lr_scheduler``, ``dataloader``
and ``train_state`` (training state, named, not compared).
"""

from __future__ import annotations

import re

from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Probe, is_dcp_dir, listdir

_STEP = re.compile(r"step-\d+")


class Torchtitan(CheckpointLayout):
    """A ``step-N`` DCP folder; its parent folder (several steps) is refused with a hint."""

    name = "torchtitan"

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A DCP directory named ``step-N``; a folder of them raises with the one to pass."""
        p = probe.path
        if probe.is_dcp:
            if not _STEP.fullmatch(p.name):
                return None
            return CheckpointInfo(p, self.name, "sharded", f"a torchtitan step folder ({p})", [p])
        if not probe.is_dir or not any(_STEP.fullmatch(n) for n in probe.names):
            return None
        steps = sorted(
            (q for q in listdir(p) if _STEP.fullmatch(q.name) and is_dcp_dir(q)),
            key=lambda q: int(q.name.split("-")[1]),
        )
        if not steps:
            return None
        raise ValueError(
            f"{p} is a torchtitan checkpoint folder with {len(steps)} step(s); pass one of them, "
            f"e.g. {steps[-1]}"
        )
