"""fsdpcheck.save: a DCP directory with fsdpcheck's manifest beside the chunks."""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe
from fsdpcheck.manifest import MANIFEST_NAME


class Native(CheckpointLayout):
    """``fsdpcheck.save``: model under ``model.``, optimizer under ``optim.``, a manifest."""

    name = "fsdpcheck"
    # NOTE: [layout ranks] First of all: its manifest is written by fsdpcheck.save alone,
    # whatever else marks the directory (a torchtitan step-N name).
    rank = 110

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A DCP directory holding ``fsdpcheck_manifest.json``."""
        p = probe.path
        if not probe.is_dcp or not (p / MANIFEST_NAME).exists():
            return None
        what = f"a DCP checkpoint written by fsdpcheck.save ({p})"
        return CheckpointInfo(p, self.name, "sharded", what, [Part(p, "any", readers.dcp)])
