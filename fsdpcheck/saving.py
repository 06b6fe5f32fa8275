"""fsdpcheck.save: a DCP checkpoint with a fingerprint manifest, written atomically.

save writes into a temporary sibling directory that is renamed into place once every rank has
finished; the manifest of a checkpoint another library wrote is built here too (trainer
integrations write one at each save).
"""

from __future__ import annotations

import datetime
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdpcheck import _version, matching
from fsdpcheck.collectives import Comm, agree
from fsdpcheck.fingerprints import FingerprintResult, fingerprint_report
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.live import inner_optimizers
from fsdpcheck.manifest import Manifest, ManifestEntry, write_manifest
from fsdpcheck.report import normalized
from fsdpcheck.sources import Source, open_source
from fsdpcheck.sources.dcp import DCPSource

__all__ = ["build_manifest", "save", "write_checkpoint_manifest"]


def save(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    overwrite: bool = False,
    group: Any = None,
) -> Manifest:
    """Saves the sharded state with DCP and writes a fingerprint manifest next to it, atomically.

    Collective. The ranks first agree on the path. The state dict comes from torch's
    ``get_state_dict`` (FQN keys, saved as ``model.<fqn>`` and ``optim.state.<fqn>.<name>``)
    and is written into a temporary sibling directory together with the manifest (per key its
    Fingerprint v1, global shape, dtype and checkpoint key; for the checkpoint its kind, world
    size, meshes, versions). Only when every rank has finished is it renamed into place, so a
    save killed half-way leaves the old checkpoint as it was and nothing ``load`` or ``audit``
    would accept, and stale files of an earlier, larger save never mix into a new one.

    Args:
        model: The (sharded) model.
        path: The checkpoint directory (must not exist or be empty, unless `overwrite`).
        optimizer: Its optimizer (or a wrapper of several), saved too when given. It must hold
            state (have stepped): fsdpcheck never initialises an optimizer's state.
        overwrite: Replace an existing checkpoint at `path` (whole: nothing of it survives).
        group: The process group.

    Returns:
        The manifest (identical on every rank).

    Raises:
        RuntimeError: On every rank, when any rank failed (the message names the rank).
        FileExistsError: `path` holds something and `overwrite` is False (on every rank).
    """
    comm = Comm(group)
    target = Path(path).absolute()
    token = secrets.token_hex(6)
    paths = comm.all_gather_object((str(target), token))
    if len({p for p, _ in paths}) != 1:
        raise RuntimeError(
            "fsdpcheck.save: the ranks were given different paths "
            f"({sorted({p for p, _ in paths})}); every rank must save to the same directory"
        )
    tmp = target.parent / f".{target.name}.fsdpcheck-tmp-{paths[0][1]}"

    def prepare() -> dict[str, Any]:
        if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(
                f"{target} exists and is not empty; pass overwrite=True to replace it"
            )
        optimizers = inner_optimizers(optimizer) if optimizer is not None else []
        empty = [i for i, o in enumerate(optimizers) if not o.state]
        if empty:
            raise ValueError(
                f"the optimizer{'s' if len(optimizers) > 1 else ''} {empty} "
                "have no state (never stepped): saving it would make torch "
                "initialise it; step it first or save without optimizer="
            )
        if comm.rank == 0:
            tmp.mkdir(parents=True)
        return _save_state(model, optimizers)

    state = agree(comm, prepare, f"fsdpcheck.save to {target}")
    try:
        from torch.distributed.checkpoint import save as dcp_save

        dcp_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=not comm.enabled)
        fps = fingerprint_report(model, optimizer=optimizer, group=group)
        manifest = agree(comm, lambda: _saved_manifest(tmp, fps, comm), "building the manifest")

        def publish() -> None:
            if comm.rank == 0:
                write_manifest(tmp, manifest)
                _replace(tmp, target)

        agree(comm, publish, f"moving the checkpoint into {target}")
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _save_state(model: torch.nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers:
        opt: Any = optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}
    return {"model": get_model_state_dict(model)}


def build_manifest(source: Source, fps: FingerprintResult, world_size: int) -> Manifest:
    """The manifest of a checkpoint from the fingerprint pass over the live state it holds.

    Args:
        source: The checkpoint as written (its keys name each entry's ``checkpoint_key``).
        fps: ``fingerprint_report`` of the live model (and optimizer) that was saved.
        world_size: Ranks that saved it.
    """
    keys = checkpoint_keys(source)
    listed = [n for n in fps.layouts if n not in fps.tied]
    by_name, unpaired = matching.match_names(listed, keys)
    entries: dict[str, ManifestEntry] = {}
    meshes: set[str] = set()
    for name, lay in sorted(fps.layouts.items()):  # the layouts the fingerprint pass computed
        if "DTensor" in lay.description:
            meshes.add(lay.description.split(" on mesh ")[-1])
        if name in fps.tied or name not in by_name:
            continue  # listed once, under the name it is tied to; or not in the checkpoint
        entries[name] = ManifestEntry(
            by_name[name],
            tuple(lay.global_shape),
            str(lay.dtype).removeprefix("torch."),
            fps.fingerprints.get(name),
        )
    return Manifest(
        kind="sharded" if source.is_sharded else "full",
        storage="dcp" if source.is_sharded else source.kind,
        world_size=world_size,
        entries=entries,
        meshes=sorted(meshes),
        torch=torch.__version__,
        fsdpcheck=_version.__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tied=dict(fps.tied),
        findings_at_save=[f.describe() for f in normalized(fps.findings + unpaired)],
    )


def write_checkpoint_manifest(
    model: torch.nn.Module,
    folder: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    files: Callable[[], list[Path]] | None = None,
    group: Any = None,
) -> Manifest:
    """Writes fsdpcheck's manifest of the live state into a checkpoint another library wrote.

    Collective. Call it right after the checkpoint was written and before the next optimizer
    step, so that the live state is what was saved (trainer integrations do).

    Args:
        model: The model that was saved.
        folder: The checkpoint folder (the manifest goes there).
        optimizer: The optimizer that was saved with it, if any.
        files: Returns the files or DCP directories holding the tensors (default: the folder
            itself); called on rank 0 only.
        group: The process group.
    """
    comm = Comm(group)
    root = Path(folder)
    fps = fingerprint_report(model, optimizer=optimizer, group=group)

    def build_and_write() -> Manifest | None:
        # Rank 0 only: trainers that write full checkpoints write them from rank 0, so other
        # ranks may see the folder before it is complete. A failure still reaches every rank.
        if comm.rank != 0:
            return None
        source = open_source(files() if files is not None else root)
        try:
            manifest = build_manifest(source, fps, comm.world)
        finally:
            source.close()
        write_manifest(root, manifest)
        return manifest

    built = agree(comm, build_and_write, f"writing the fsdpcheck manifest of {root}")
    manifest: Manifest = comm.all_gather_object(built)[0]
    return manifest


def _saved_manifest(tmp: Path, fps: FingerprintResult, comm: Comm) -> Manifest:
    source = DCPSource(tmp)
    try:
        return build_manifest(source, fps, comm.world)
    finally:
        source.close()


def _replace(tmp: Path, target: Path) -> None:
    """Renames `tmp` to `target`; an existing target is moved aside first, then removed."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.fsdpcheck-old-{secrets.token_hex(6)}"
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
