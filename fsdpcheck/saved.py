"""What ``fsdpcheck.save`` writes, to a directory or to a URL: the parts both saves share.

The state dict a save writes (``save_state``), the manifest of a written checkpoint
(``build_manifest``, ``dcp_saves``, and which DCP save a directory holds), and the named steps a
save reaches (``reached``), where the tests kill it. ``saving`` (a directory, atomically) and
``saving_remote`` (a URL) both import it; neither imports the other's internals.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck import _version, matching
from fsdpcheck.formats import is_dcp_dir
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.live import has_own_hooks, model_parts
from fsdpcheck.manifest import Manifest, ManifestEntry, SaveIdentity, sha256_of
from fsdpcheck.report import normalized
from fsdpcheck.sources.dcp.metadata import METADATA_FILE, read_dcp_metadata
from fsdpcheck.sources.remote import RemotePath

if TYPE_CHECKING:
    from fsdpcheck.fingerprints import FingerprintResult
    from fsdpcheck.sources import Source

__all__ = [
    "build_manifest",
    "dcp_saves",
    "reached",
    "remote_identity",
    "save_id_of",
    "save_state",
]

# Called with the name of each step of a save once it is done (tests kill the process there).
_STEP_HOOK: Callable[[str], None] | None = None


def reached(name: str) -> None:
    """A save has done the step `name` (``_STEP_HOOK`` sees it)."""
    if _STEP_HOOK is not None:
        _STEP_HOOK(name)


def save_state(model: Any, optimizers: list[Any]) -> dict[str, Any]:
    """The state dict to save: every model part's, optimizer state flattened per parameter.

    NOTE: [flattened optimizer state] Hyperparameters are saved per parameter
    (``optim.param_groups.<fqn>.<name>``, torch's ``flatten_optimizer_state_dict``), not per
    group index: pipeline stages each have a group 0, and DCP keeps one value per key, so
    grouped by index every stage but one would lose its hyperparameters.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    parts = model_parts(model)
    if parts is None:
        raise TypeError(f"model must be an nn.Module or a list of them, not {type(model).__name__}")
    msd: dict[str, Any] = {}
    for part in parts:
        if has_own_hooks(part):  # NOTE: [own state-dict hooks] in ``live``
            raise TypeError(
                f"fsdpcheck.save cannot save {type(part).__name__}: its modules' own state-dict "
                "hooks change what it saves (and would gather it); save it with its library's "
                "checkpointer and check that with fsdpcheck.verify, which follows the hooks"
            )
        msd.update(get_model_state_dict(part))
    if not optimizers:
        return {"model": msd}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    if len(parts) == 1:
        opt: Any = optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
        return {"model": msd, "optim": get_optimizer_state_dict(parts[0], opt, options=flat)}
    if len(optimizers) != len(parts):
        raise ValueError(
            f"{len(parts)} model parts but {len(optimizers)} optimizers: pass one optimizer per "
            "part, in the same order (torchtitan's OptimizersContainer does)"
        )
    osd: dict[str, Any] = {}
    for part, opt in zip(parts, optimizers):
        osd.update(get_optimizer_state_dict(part, opt, options=flat))
    return {"model": msd, "optim": osd}


def build_manifest(
    source: Source,
    fps: FingerprintResult,
    world_size: int,
    saves: dict[str, SaveIdentity] | None = None,
) -> Manifest:
    """The manifest of a checkpoint from the fingerprint pass over the live state it holds.

    Args:
        source: The checkpoint as written (its keys name each entry's ``checkpoint_key``).
        fps: ``fingerprint_report`` of the live model (and optimizer) that was saved.
        world_size: Ranks that saved it.
        saves: The DCP save(s) it describes (``dcp_saves``), by directory relative to the
            manifest's folder.
    """
    keys = checkpoint_keys(source)
    listed = [n for n in fps.metas if n not in fps.tied]
    by_name, unpaired = matching.match_names(
        listed, keys, order=fps.order, read_objects=source.read_objects
    )
    entries: dict[str, ManifestEntry] = {}
    meshes: set[str] = set()
    for lay in fps.layouts.values():  # this rank's layouts (a pipeline stage's meshes only)
        if "DTensor" in lay.description:
            meshes.add(lay.description.split(" on mesh ")[-1])
    for name, meta in sorted(fps.metas.items()):  # every key of the job
        if name in fps.tied or name not in by_name:
            continue  # listed once, under the name it is tied to; or not in the checkpoint
        entries[name] = ManifestEntry(
            by_name[name], tuple(meta.shape), meta.dtype, fps.fingerprints.get(name)
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
        saves=dict(saves or {}),
    )


def dcp_saves(root: Any, parts: Sequence[Any]) -> dict[str, SaveIdentity]:
    """Which DCP save each DCP directory among `parts` holds, by path relative to `root`.

    Parts that are not DCP directories, lie outside `root`, or whose metadata carries no save
    id (torch before 2.4) are left out.
    """
    out = {}
    for part in parts:
        if not is_dcp_dir(part):
            continue
        if isinstance(part, RemotePath):  # one read of .metadata gives both
            if not isinstance(root, RemotePath) or part.relative(root) == str(part):
                continue
            save_id, digest = remote_identity(part)
            if save_id is not None:
                out[part.relative(root)] = SaveIdentity(save_id, digest)
            continue
        try:
            rel = part.absolute().relative_to(root.absolute()).as_posix()
        except ValueError:
            continue
        save_id = save_id_of(part)
        if save_id is not None:
            out[rel] = SaveIdentity(save_id, sha256_of(part / METADATA_FILE))
    return out


def remote_identity(d: RemotePath) -> tuple[str | None, str]:
    """(DCP save id, sha256 of ``.metadata``) of a DCP directory in an object store."""
    from fsdpcheck.sources.dcp.index import read_parsed

    parsed = read_parsed(d, columns=False)
    save_id = getattr(getattr(parsed.metadata, "storage_meta", None), "save_id", None)
    return (save_id if isinstance(save_id, str) else None), parsed.digest


def save_id_of(d: Path) -> str | None:
    """The DCP save id a local DCP directory's ``.metadata`` carries (None before torch 2.4)."""
    meta = getattr(read_dcp_metadata(d), "storage_meta", None)
    save_id = getattr(meta, "save_id", None)
    return save_id if isinstance(save_id, str) else None
