"""Lightning: ``.ckpt`` files, and distributed checkpoints (a DCP directory with ``meta.pt``).

A LightningModule's keys carry its own attribute names (``model.`` for a module holding
``self.model``); Fabric's wrapper adds ``_forward_module.``. Optimizers sit under
``optimizer_states`` (a list) in a ``.ckpt`` and under ``optimizer_<i>`` in a distributed save.
"""

from __future__ import annotations

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe, side_file_note


class Lightning(CheckpointLayout):
    """``trainer.save_checkpoint`` (.ckpt) and ``ModelParallelStrategy`` directories."""

    name = "lightning"
    # NOTE: [layout ranks] meta.pt marks a DCP directory (band 100); its .ckpt files come
    # before torch.save's suffix rule with it.
    rank = 130

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A ``.ckpt`` file, or a DCP directory with Lightning's ``meta.pt``."""
        p = probe.path
        if probe.is_dcp:
            if not (p / "meta.pt").is_file():
                return None
            return CheckpointInfo(
                p,
                self.name,
                "sharded",
                f"a Lightning distributed checkpoint ({p})",
                [Part(p, "any", readers.dcp)],
                side_file_note(p, "meta.pt", "Lightning's non-tensor state (epoch, loops, ...)"),
            )
        if probe.is_dir or p.suffix != ".ckpt":
            return None
        what = f"a Lightning checkpoint file ({p.name})"
        return CheckpointInfo(p, self.name, "full", what, [Part(p, "any", readers.torch_save)])
