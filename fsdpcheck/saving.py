"""fsdpcheck.save: a DCP checkpoint with a fingerprint manifest, written atomically.

save writes into a scratch sibling directory that takes the target's place in one atomic step
once every rank has finished (NOTE: [atomic publication]); the manifest of a checkpoint another
library wrote is built here too (trainer integrations write one at each save).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fsdpcheck._collector import paused
from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import ARGUMENTS, Call, RankFailure, call
from fsdpcheck.errors import RankStoppedError, describe_error, root_cause
from fsdpcheck.fingerprints import FingerprintResult, fingerprint_report
from fsdpcheck.live import inner_optimizers
from fsdpcheck.manifest import Manifest, fsync_dir, sha256_of, write_manifest
from fsdpcheck.reading.references import open_source
from fsdpcheck.saved import (
    build_manifest,
    dcp_saves,
    reached,
    remote_identity,
    save_id_of,
    save_state,
)
from fsdpcheck.saving_remote import save_to_url
from fsdpcheck.sources.dcp.metadata import METADATA_FILE
from fsdpcheck.sources.dcp.source import DCPSource
from fsdpcheck.sources.remote import RemotePath, is_url, location

__all__ = ["build_manifest", "dcp_saves", "save", "stale_reason", "write_checkpoint_manifest"]


def save(
    model: Any,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    overwrite: bool = False,
    group: Any = None,
    timeout: float | None = None,
) -> Manifest:
    """Saves the sharded state with DCP and writes a fingerprint manifest next to it, atomically.

    Collective. The ranks first agree on the path. The state dict comes from torch's
    ``get_state_dict`` (FQN keys, saved as ``model.<fqn>`` and ``optim.state.<fqn>.<name>``)
    and is written into a hidden scratch sibling directory together with the manifest (per key
    its Fingerprint v1, global shape, dtype and checkpoint key; for the checkpoint its kind,
    world size, meshes, versions, DCP save id). Only when every rank has finished does it take
    the target's place, in one atomic step (NOTE: [atomic publication]): killed at any instant,
    the target holds the old checkpoint or the new one, whole, and stale files of an earlier,
    larger save never mix into a new one. A symlinked target is written through.

    Args:
        model: The (sharded) model, or the model parts this rank runs (pipeline stages).
        path: The checkpoint directory (must not exist or be empty, unless `overwrite`), or a
            URL (``s3://...``: written through DCP's fsspec writer, the manifest last; there is
            no atomic replacement in an object store, see NOTE: [saving to object storage]).
        optimizer: Its optimizer (or a wrapper of several), saved too when given. It must hold
            state (have stepped): fsdpcheck never initialises an optimizer's state.
        overwrite: Replace an existing checkpoint at `path` (whole: nothing of it survives).
        group: The process group.
        timeout: Seconds a rank waits in one collective (DCP's included) for the others before
            it names the ranks that did not answer (default: the process group's timeout,
            which is this for the call's length).

    `path`, `overwrite` and whether an optimizer is given must be the same on every rank
    (compared in the first collective: ``RanksDisagreeError`` on every rank otherwise).

    Returns:
        The manifest (identical on every rank).

    Raises:
        RuntimeError: On every rank, when any rank failed (the message names the rank and the
            root cause; ``RankStoppedError`` when a rank died).
        OSError: DCP's writing failed with a system error (a full disk: "No space left on
            device"), on every rank; the target is as it was.
        FileExistsError: `path` holds something and `overwrite` is False (on every rank).
        RankStoppedError: A rank stopped answering, on every rank that still answers.
    """
    with paused(), call("fsdpcheck.save", group, timeout) as c:  # NOTE: [collector]
        try:
            if is_url(path):  # NOTE: [saving to object storage] in saving_remote
                return save_to_url(c, model, str(path), optimizer, overwrite, group)
            return _save(c, model, path, optimizer, overwrite, group)
        except RankFailure as f:
            raise f.failure.error() from None


def _save(
    c: Call, model: Any, path: str | os.PathLike[str], optimizer: Any, overwrite: bool, group: Any
) -> Manifest:
    comm = c.comm

    def where() -> tuple[Path, Path]:
        c.arguments(optimizer=given(optimizer), overwrite=bool(overwrite), url=False)
        absolute = Path(location(path)).absolute()  # file://: a local path
        return absolute, resolve_target(absolute)

    named, target = c.local(ARGUMENTS, where, (Path(str(path)), Path(str(path))))
    # The same directory everywhere (one all-reduce when the ranks agree: NOTE: [bytes per
    # rank]); the scratch name from rank 0.
    groups = c.exchange("agreeing on the path", (str(named), str(target)))
    if len(groups) > 1:
        raise RuntimeError(
            "fsdpcheck.save: the ranks were given different paths "
            f"({sorted({g.payload[0] for g in groups})}) or see them lead to different "
            f"directories ({sorted({g.payload[1] for g in groups})}); every rank must save to "
            "the same directory"
        )
    tmp = scratch_dir(target, comm.broadcast_object(secrets.token_hex(6), 0, "naming the scratch"))

    def prepare() -> dict[str, Any]:
        if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(
                f"{named} exists and is not empty; pass overwrite=True to replace it"
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
            remove_leftovers(target)
            tmp.mkdir(parents=True)
        return save_state(model, optimizers)

    try:
        state = c.step(f"fsdpcheck.save to {named}", prepare)
        reached("scratch made")
        _dcp_save(state, tmp, named, group, c)
        reached("state written")
        fps = fingerprint_report(model, optimizer=optimizer, group=group)
        if fps.failure is not None:  # agreed on in the pass: the same on every rank
            fps.failure.raise_()
        # Rank 0 reads what DCP wrote and builds the manifest; the others get it from rank 0
        # (one broadcast of O(keys)), so it is read once per job and identical everywhere.
        built = c.step(
            "building the manifest",
            lambda: _saved_manifest(tmp, fps, comm) if comm.rank == 0 else None,
        )
        manifest: Manifest = comm.broadcast_object(built, 0, "sending the manifest")

        def publish() -> None:
            if comm.rank == 0:
                write_manifest(tmp, manifest)
                reached("manifest written")
                publish_dir(tmp, target)

        c.step(f"moving the checkpoint into {named}", publish)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _dcp_save(state: dict[str, Any], tmp: Path, given: Path, group: Any, c: Call) -> None:
    """DCP's save into the scratch directory; its failure in one line naming the root cause."""
    from torch.distributed.checkpoint import save as dcp_save

    comm = c.comm
    try:
        with comm.foreign("DCP writing the state"):
            dcp_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=not comm.enabled)
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, RankStoppedError)):
            raise
        rank, cause = root_cause(exc)
        on = f" on rank {rank}" if rank is not None and comm.world > 1 else ""
        message = (
            f"fsdpcheck.save to {given} failed{on}: {describe_error(cause)} (while DCP wrote "
            f"the state into {tmp.name}; {given} is as it was)"
        )
        if isinstance(cause, OSError):
            err = OSError(message)
            err.errno = cause.errno
            raise err from None
        raise RuntimeError(message) from None


def write_checkpoint_manifest(
    model: Any,
    folder: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    files: Callable[[], list[Path]] | None = None,
    group: Any = None,
    timeout: float | None = None,
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
        timeout: Seconds a rank waits in one collective for the others (default: the group's).
    """
    with call("write_checkpoint_manifest", group, timeout) as c:
        try:
            return _write_checkpoint_manifest(c, model, folder, optimizer, files, group)
        except RankFailure as f:
            raise f.failure.error() from None


def _write_checkpoint_manifest(
    c: Call,
    model: Any,
    folder: str | os.PathLike[str],
    optimizer: Any,
    files: Callable[[], list[Path]] | None,
    group: Any,
) -> Manifest:
    comm = c.comm
    root = Path(folder)
    c.arguments(optimizer=given(optimizer), files=given(files))
    fps = fingerprint_report(model, optimizer=optimizer, group=group)
    if fps.failure is not None:  # agreed on in the pass: the same on every rank
        fps.failure.raise_()

    def build_and_write() -> Manifest | None:
        # Rank 0 only: trainers that write full checkpoints write them from rank 0, so other
        # ranks may see the folder before it is complete. A failure still reaches every rank.
        if comm.rank != 0:
            return None
        parts = files() if files is not None else [root]
        source = open_source(parts if files is not None else root)
        try:
            manifest = build_manifest(source, fps, comm.world, dcp_saves(root, parts))
        finally:
            source.close()
        write_manifest(root, manifest)
        return manifest

    built = c.step(f"writing the fsdpcheck manifest of {root}", build_and_write)
    manifest: Manifest = comm.broadcast_object(built, 0, "sending the manifest")
    return manifest


def _saved_manifest(tmp: Path, fps: FingerprintResult, comm: Any) -> Manifest:
    source = DCPSource(tmp)
    try:
        return build_manifest(source, fps, comm.world, dcp_saves(tmp, [tmp]))
    finally:
        source.close()


def stale_reason(
    folder: Any, manifest: Manifest, digests: Mapping[Any, str] | None = None
) -> str | None:
    """Why the manifest belongs to an earlier save than the checkpoint beside it, or None.

    A DCP save writes a new save id into ``.metadata``; a manifest that names another one was
    left behind by an earlier save (typically a plain ``dcp.save`` into a folder that
    ``fsdpcheck.save`` wrote before): its shapes and fingerprints describe that save, and
    mismatches against it say nothing about this one. A ``.metadata`` changed some other way
    (damaged, edited) keeps its save id: that is for the structure checks to report.

    `digests` holds the sha256 of ``.metadata`` folders already read (``DCPSource``'s
    ``metadata_digest``), so that a 150 MB ``.metadata`` is not hashed a second time.
    """
    for rel, want in sorted(manifest.saves.items()):
        d: Any = folder / rel if isinstance(folder, RemotePath) else Path(folder) / rel
        try:
            known = digests.get(d) if digests else None
            if known == want.metadata_sha256:
                continue
            if isinstance(d, RemotePath):  # one read of its .metadata gives both
                have, digest = remote_identity(d)
                if digest == want.metadata_sha256:
                    continue
            else:
                if (known or sha256_of(d / METADATA_FILE)) == want.metadata_sha256:
                    continue
                have = save_id_of(d)
        except (OSError, ValueError):  # unreadable or gone: the structure checks say so
            continue
        if have is not None and have != want.save_id:
            where = "" if rel == "." else f" in {rel}"
            return (
                f"the manifest is stale: it was written for an earlier save (DCP save id "
                f"{want.save_id}; the checkpoint{where} is save {have}: another save wrote "
                "into this folder after it), so its shapes and fingerprints describe that save"
            )
    return None


# -------------------------------------------------------------------------------------------
# NOTE: [atomic publication] At every instant the target path holds either the old complete
# checkpoint or the new complete one, whatever kills the process:
# - every rank writes into a scratch sibling, ``.<name>.fsdpcheck-tmp-<token>`` (hidden, and
#   never a name any reader recognises as a checkpoint); the manifest goes in last, itself
#   written to a hidden file, flushed and renamed;
# - the scratch directory then takes the target's place in ONE step: rename(2) when there is
#   no target or an empty directory, renameat2(RENAME_EXCHANGE) over an existing checkpoint
#   (the two names swap atomically; Linux 3.15+, on ext4, xfs, btrfs, tmpfs, overlayfs, ...),
#   after which the old checkpoint, now under the scratch name, is deleted;
# - a kill leaves at most a scratch directory (half-written, or the old checkpoint half
#   deleted), which the next save to the same target removes before it starts.
# Where the filesystem cannot exchange (EINVAL: NFS, FUSE, CIFS, ...) the old checkpoint is
# renamed aside first, so between the two renames the target is briefly absent; the old one is
# whole under ``.<name>.fsdpcheck-old-<token>``. A symlinked target is written through: the
# link stays and the directory it leads to is replaced (its leftovers sit beside that).
# Each step is announced once done (``saved.reached``): the tests kill a save there.

_LEFTOVER_TAGS = (".fsdpcheck-tmp-", ".fsdpcheck-old-")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def resolve_target(path: Path) -> Path:
    """The directory a save to `path` replaces: `path`, or where its symlinks lead."""
    return Path(os.path.realpath(path))


def scratch_dir(target: Path, token: str) -> Path:
    """The scratch sibling a save to `target` writes into."""
    return target.parent / f".{target.name}{_LEFTOVER_TAGS[0]}{token}"


def remove_leftovers(target: Path) -> list[str]:
    """Removes what killed saves to `target` left beside it; returns their names."""
    if not target.parent.is_dir():
        return []
    removed = []
    prefixes = tuple(f".{target.name}{tag}" for tag in _LEFTOVER_TAGS)
    for q in target.parent.iterdir():
        if q.name.startswith(prefixes):
            _remove(q)
            removed.append(q.name)
    return removed


def publish_dir(tmp: Path, target: Path) -> None:
    """Puts `tmp` in `target`'s place atomically (NOTE: [atomic publication])."""
    if not os.path.lexists(target) or (target.is_dir() and not any(target.iterdir())):
        # rename(2) onto nothing, or onto an empty directory, is one atomic step; if something
        # appears there meanwhile it fails (ENOTEMPTY, EEXIST) and replaces nothing.
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        reached("published")
        _remove(tmp)  # the old checkpoint, under the scratch name now
    else:
        old = target.parent / f".{target.name}{_LEFTOVER_TAGS[1]}{tmp.name.rsplit('-', 1)[-1]}"
        os.rename(target, old)
        reached("old moved aside")
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)  # the old one back in its place
            raise
        reached("published")
        _remove(old)
    fsync_dir(target.parent)
    reached("old removed")


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:  # glibc before 2.28
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
