"""DeepSpeed universal checkpoints (``deepspeed.checkpoint.ds_to_universal``).

What Megatron-DeepSpeed reshards from (``--universal-checkpoint``; DeepSpeed's
``load_universal_checkpoint``). ``ds_to_universal --output_folder <root>/<tag>_universal``
writes (DeepSpeed 0.19.8, ``ds_to_universal.py``: ``merge_tp_slices``, ``main``):

- ``zero/<fqn>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ``{"param": <the full tensor>,
  "cat_dim": <the dim its tensor-parallel slices were joined along>}`` (plus ``vocab_tensor`` /
  ``sub_param_shape`` flags for padded vocabularies and fused sub-parameters): the fp32 master
  weight and the Adam moments of each parameter, whole. Read as ``optim.state.<fqn>.fp32`` (the
  master copy the ZeRO optimizer keeps) and ``optim.state.<fqn>.<name>``.
- ``zero/<fqn>/step.pt``: the step, a bare tensor: ``optim.state.<fqn>.step``.
- ``zero/optimizer_state.pt``: the optimizer's settings (loss scaler, param groups) pickled as
  DeepSpeed objects: named, never unpickled.
- ``mp_rank_XX_model_states.pt``: copied from the input, the module weights (``module``) of each
  tensor-parallel rank, as in a DeepSpeed checkpoint.
- ``<root>/latest_universal``: the name of the ``<tag>_universal`` folder.

The ``zero/`` folder is read by ``fsdpcheck.sources.ds_universal``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.formats import readers
from fsdpcheck.formats.base import CheckpointInfo, CheckpointLayout, Part, Probe
from fsdpcheck.formats.deepspeed import is_model_states
from fsdpcheck.sources.ds_universal import OPTIMIZER_STATE, UniversalZeroSource, model_states

if TYPE_CHECKING:
    from fsdpcheck.sources.base import Source
    from fsdpcheck.sources.dcp.source import Verdicts
    from fsdpcheck.sources.remote import RemotePath

ZERO = "zero"
LATEST = "latest_universal"


def read_zero(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """The reader of the ``zero/`` folder: each parameter's fp32 weight and moments, whole."""
    del trust
    return UniversalZeroSource(path)  # type: ignore[arg-type]  # a local path


class DeepSpeedUniversal(CheckpointLayout):
    """A ``<tag>_universal`` folder (or the folder whose ``latest_universal`` names one)."""

    name = "deepspeed_universal"
    # NOTE: [layout ranks] Before deepspeed (320): a universal folder holds DeepSpeed's
    # model-states files too.
    rank = 310

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """A ``zero/`` folder beside ``*mp_rank_*_model_states.pt``, or ``latest_universal``.

        A folder holding ``latest`` as well is a DeepSpeed checkpoint folder first (what
        ``load_checkpoint`` reads unless told to load the universal one).
        """
        p = probe.path
        if not probe.is_dir or probe.is_dcp:
            return None
        if ZERO in probe.names and (p / ZERO).is_dir():
            if any(is_model_states(n) for n in probe.names):
                return self._info(p, p)
            return None
        if probe.has_file(LATEST) and "latest" not in probe.names:
            return self._info(p, _tag(p))
        return None

    def _info(self, p: Path, folder: Path) -> CheckpointInfo:
        if not (folder / ZERO).is_dir():
            raise ValueError(f"{folder} holds no zero/ folder of a DeepSpeed universal checkpoint")
        states = model_states(folder)
        if not states:
            raise ValueError(f"{folder} holds no DeepSpeed *mp_rank_*_model_states.pt")
        notes = []
        if (folder / ZERO / OPTIMIZER_STATE).exists():
            notes.append(
                f"{ZERO}/{OPTIMIZER_STATE} holds DeepSpeed's optimizer settings (loss scaler, "
                "param groups) as DeepSpeed objects: not read (fsdpcheck runs no pickle)"
            )
        return CheckpointInfo(
            p,
            self.name,
            "full",
            f"a DeepSpeed universal checkpoint ({folder.name}/: {ZERO}/, {states[0].name})",
            [
                Part(states[0], "any", readers.torch_save),
                Part(folder / ZERO, "optimizer", read_zero),
            ],
            notes,
        )


def _tag(p: Path) -> Path:
    try:
        tag = (p / LATEST).read_text(errors="replace")[:4096].strip()
    except OSError as exc:
        raise ValueError(f"cannot read {p / LATEST}: {exc.strerror or exc}") from None
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise ValueError(f"{p / LATEST} does not name a checkpoint folder inside {p}")
    return p / tag
