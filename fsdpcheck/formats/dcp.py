"""Plain DCP directories (``torch.distributed.checkpoint.save`` with any state dict)."""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe


class Dcp(CheckpointLayout):
    """Any DCP directory no more specific layout claimed."""

    name = "dcp"
    # NOTE: [layout ranks] Any DCP directory (band 200): after every layout that marks one.
    rank = 200

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A directory holding ``.metadata``."""
        if not probe.is_dcp:
            return None
        p = probe.path
        what = f"a DCP checkpoint directory ({p})"
        return CheckpointInfo(p, self.name, "sharded", what, [Part(p, "any", readers.dcp)])
