"""megatron-core ``dist_checkpointing``: a DCP directory with megatron's ``metadata.json``.

Its optimizer state is keyed ``optimizer.state.<state name>.<parameter key>``
(``megatron/core/dist_checkpointing/optimizer.py``: ``make_sharded_optimizer_tensor`` names the
key ``f'{prefix}.{model_param.key}'`` with ``prefix=f'optimizer.state.{state_key}'``): the state
name comes first, the other way round from torch's flattened ``state.<fqn>.<name>``; Adam's
``step`` is kept with the param groups, not per parameter. Homogeneous
layers may be saved stacked (one tensor with a leading layer axis, ``sharded_pp_offset``); a
per-layer live model does not pair with those by name, and the report says which are unpaired.
"""

from __future__ import annotations

import json

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import (
    CheckpointInfo,
    CheckpointLayout,
    KeyGrammar,
    Part,
    Probe,
    side_file_note,
)


class Megatron(CheckpointLayout):
    """megatron-core ``dist_checkpointing.save`` (``sharded_backend`` in metadata.json)."""

    name = "megatron"
    grammar = KeyGrammar(state_name_first=True, step_per_parameter=False)
    # NOTE: [layout ranks] Its metadata.json marks a DCP directory (band 100).
    rank = 120

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A DCP directory whose ``metadata.json`` names a ``sharded_backend``."""
        p = probe.path
        meta = p / "metadata.json"
        if not probe.is_dcp or not meta.is_file() or meta.stat().st_size >= 1 << 20:
            return None
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except (ValueError, AttributeError, UnicodeDecodeError, OSError):
            return None
        if not backend:
            return None
        return CheckpointInfo(
            p,
            self.name,
            "sharded",
            f"a megatron-core dist_checkpointing directory ({str(backend)[:40]}, {p})",
            [Part(p, "any", readers.dcp)],
            side_file_note(p, "common.pt", "megatron's non-tensor state (iteration, args, ...)"),
        )
