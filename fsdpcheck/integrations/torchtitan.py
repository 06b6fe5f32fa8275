"""torchtitan: verify what ``CheckpointManager.load`` restored, and write a manifest at each save.

Example::

    checkpointer = CheckpointManager.Config(...).build(model_parts=model_parts, ...)
    save_manifests(checkpointer)          # each step-N/ gets fsdpcheck_manifest.json
    checkpointer.load(step=-1)
    verify_after_load(checkpointer).raise_if_failed()

With a manifest, the check after a load is one fingerprint pass over every rank's shards (no
second read of the checkpoint); without one (a step folder written before ``save_manifests``),
it is ``fsdpcheck.verify`` against the step folder.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import RankFailure, call
from fsdpcheck.formats.torchtitan import latest_step_folder, step_of
from fsdpcheck.integrations._resume import verify_resumed, write_checkpoint_manifest
from fsdpcheck.manifest import Manifest
from fsdpcheck.report import Report

__all__ = ["latest_step_folder", "save_manifests", "verify_after_load", "write_step_manifest"]


def verify_after_load(
    checkpointer: Any,
    *,
    step: int = -1,
    model_parts: list[torch.nn.Module] | None = None,
    optimizers: Any = None,
    group: Any = None,
    timeout: float | None = None,
    **verify_kwargs: Any,
) -> Report:
    """Checks the model parts and optimizers against the step folder ``load()`` restored.

    Collective: every rank calls it, after ``checkpointer.load(step)``. The folder is found as
    torchtitan finds it (``step-N`` under ``checkpointer.folder``, the latest when `step` is
    -1, else ``initial_load_path``); the optimizer is checked unless torchtitan loaded the
    model only (step 0, ``initial_load_model_only``, or ``"optimizer"`` in
    ``exclude_from_loading``).

    Args:
        checkpointer: The ``CheckpointManager``.
        step: The step given to ``load`` (-1: the latest).
        model_parts: The model parts (default: those the checkpointer holds): one, or the
            pipeline stages this rank runs (ranks of different stages hold different keys;
            each key is checked on the ranks that hold it, with one verdict for the job).
        optimizers: The ``OptimizersContainer`` (default: the checkpointer's).
        group: The process group.
        timeout: Seconds a rank waits in one collective for the others before it names the
            ranks that did not answer (default: the process group's timeout).
        **verify_kwargs: Passed to ``fsdpcheck.verify`` when the folder has no manifest.

    Returns:
        The Report, identical on every rank. An OK report with a note when nothing was loaded
        (a fresh start, or a disabled checkpointer).

    A load from Hugging Face safetensors (``initial_load_in_hf``) is checked through the
    checkpointer's state dict adapter (``convert=``), model only.

    Raises:
        ValueError: On every rank, for a load from Hugging Face safetensors when the
            checkpointer holds no state dict adapter.
        RanksDisagreeError: The ranks found different folders (or `step` differs).
    """
    with call("torchtitan verify_after_load", group, timeout) as c:
        enabled = bool(getattr(checkpointer, "enable", False))
        adapter = given(getattr(checkpointer, "sd_adapter", None))
        c.arguments(step=step, enabled=enabled, optimizers=given(optimizers), adapter=adapter)
        try:
            folder, model_only = c.step(
                "finding the checkpoint torchtitan loaded",
                lambda: _loaded_folder(checkpointer, step) if enabled else (None, False),
                agree_on=lambda f: (f[0].name if f[0] is not None else None, f[1]),
            )
        except RankFailure as f:
            raise f.failure.error() from None
        if not enabled:
            return Report(
                world_size=c.comm.world, notes=["the checkpointer is disabled: nothing loaded"]
            )
        return _verify_loaded(checkpointer, folder, model_only, model_parts, optimizers, group,
                              c.comm.world, verify_kwargs)  # fmt: skip


def _verify_loaded(
    checkpointer: Any,
    folder: Path | None,
    model_only: bool | str,
    model_parts: list[torch.nn.Module] | None,
    optimizers: Any,
    group: Any,
    world: int,
    verify_kwargs: dict[str, Any],
) -> Report:
    states = checkpointer.states
    parts = model_parts if model_parts is not None else states["model"].model
    if folder is None:
        return Report(world_size=world, notes=["no checkpoint was loaded (a fresh start)"])
    if model_only == "hf":
        # Loaded through the checkpointer's state dict adapter: checked through its to_hf.
        adapter = getattr(checkpointer, "sd_adapter", None)
        if adapter is None:
            raise ValueError(
                f"{folder} was loaded from Hugging Face safetensors through a state dict "
                "adapter the checkpointer no longer holds; check the model with "
                "fsdpcheck.verify(model, folder, convert=adapter)"
            )
        verify_kwargs.setdefault("convert", adapter)
    optimizer = None if model_only else _optimizers(checkpointer, optimizers)
    model = parts[0] if len(parts) == 1 else list(parts)
    report = verify_resumed(model, folder, optimizer=optimizer, group=group, **verify_kwargs)
    report.notes.insert(0, f"torchtitan loaded {folder}" + (" (model only)" if model_only else ""))
    return report


def _optimizers(checkpointer: Any, optimizers: Any) -> Any:
    return optimizers if optimizers is not None else checkpointer.states.get("optimizer")


def _loaded_folder(checkpointer: Any, step: int) -> tuple[Path | None, bool | str]:
    """(folder, model_only) of what ``load(step)`` read: model_only is True, False or "hf"."""
    root = Path(checkpointer.folder)
    found = latest_step_folder(root) if step == -1 else root / f"step-{step}"
    excluded = "optimizer" in getattr(checkpointer, "exclude_from_loading", [])
    if found is not None and found.is_dir():
        return found, (step_of(found) == 0 or excluded)
    if step != -1:
        raise FileNotFoundError(f"{found} does not exist: nothing was loaded from it")
    initial = getattr(checkpointer, "initial_load_path", None)
    if getattr(checkpointer, "initial_load_in_hf", False):
        return Path(initial) if initial else None, "hf"
    if initial:
        return Path(initial), bool(checkpointer.initial_load_model_only) or excluded
    return None, False


def write_step_manifest(
    checkpointer: Any,
    step: int,
    *,
    model_parts: list[torch.nn.Module] | None = None,
    optimizers: Any = None,
    group: Any = None,
    timeout: float | None = None,
) -> Manifest:
    """Writes fsdpcheck's manifest into ``step-<step>/`` for what ``save(step)`` just wrote.

    Collective. Call it right after a synchronous ``checkpointer.save(step)`` returned True and
    before the next optimizer step: the fingerprints are of the live state, which then equals
    what was saved. ``save_manifests`` does this on every save.

    Returns:
        The manifest (identical on every rank).
    """
    with call("torchtitan write_step_manifest", group, timeout) as c:
        parts = model_parts if model_parts is not None else checkpointer.states["model"].model
        optimizer = _optimizers(checkpointer, optimizers)
        asynchronous = (
            getattr(checkpointer, "async_mode", None) is not None
            and str(getattr(checkpointer.async_mode, "value", checkpointer.async_mode))
            != "disabled"
        )
        c.arguments(step=step, asynchronous=asynchronous)
        if asynchronous:
            # The fingerprints are taken now (the state staged for saving); the manifest may
            # only appear once the folder is complete.
            c.local("waiting for torchtitan's save", checkpointer.maybe_wait_for_saving)
        where = Path(checkpointer.folder) / f"step-{step}"
        model = parts[0] if len(parts) == 1 else list(parts)
        return write_checkpoint_manifest(model, where, optimizer=optimizer, group=group)


def save_manifests(checkpointer: Any, *, group: Any = None) -> Any:
    """Makes ``checkpointer.save`` write fsdpcheck's manifest into every ``step-N`` it writes.

    Wraps the instance's ``save``: after a save that wrote a step folder, every rank
    fingerprints its shards (one fused pass; the rows all-reduced, O(keys) bytes per rank) and
    rank 0 writes ``step-N/fsdpcheck_manifest.json`` (key -> fingerprint, shape, dtype,
    checkpoint key), so ``verify_after_load``, ``fsdpcheck.load``, ``fsdpcheck audit`` and
    ``fsdpcheck inspect`` check against it. The last-step export (model only,
    ``export_dtype``, maybe Hugging Face format) is not a resume checkpoint and gets no
    manifest. With async checkpointing the manifest write waits for that save to finish.

    Returns:
        The checkpointer (its ``save`` wrapped once; a second call changes nothing).
    """
    if not getattr(checkpointer, "enable", False) or getattr(
        checkpointer.save, "_fsdpcheck_manifest", False
    ):
        return checkpointer
    original = checkpointer.save

    @functools.wraps(original)
    def save(curr_step: int, last_step: bool = False) -> bool:
        wrote = original(curr_step, last_step)
        export = last_step and getattr(checkpointer, "last_save_model_only", False)
        if wrote and not export:
            write_step_manifest(checkpointer, curr_step, group=group)
        return wrote

    save._fsdpcheck_manifest = True  # type: ignore[attr-defined]
    checkpointer.save = save
    return checkpointer
