"""fsdpcheck.save to a URL: DCP's fsspec writer, then the manifest beside ``.metadata``.

NOTE: [saving to object storage] An object store has no directories to rename, so the atomic
publication of a local save (NOTE: [atomic publication] in ``saving``) has no equal. What holds
instead: DCP writes the data objects, then ``.metadata`` last (a prefix without it is not a
checkpoint to any reader); fsdpcheck then reads back what was written, builds the manifest on
rank 0 and writes it as one object last (one PUT is atomic), so a manifest is only ever beside
the save it describes. ``overwrite=True`` deletes every object under the prefix first: a save
killed after that leaves no checkpoint there (never a mix of two saves); a reader that lists
the prefix meanwhile sees an incomplete one.
"""

from __future__ import annotations

import json
from typing import Any

from fsdpcheck._compat import fsspec_writer
from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import ARGUMENTS, Call
from fsdpcheck.errors import RankStoppedError, describe_error, root_cause
from fsdpcheck.fingerprints import fingerprint_report
from fsdpcheck.live import inner_optimizers
from fsdpcheck.manifest import MANIFEST_NAME, Manifest
from fsdpcheck.saved import build_manifest, dcp_saves, reached, save_state
from fsdpcheck.sources.remote import RemotePath, location

__all__ = ["save_to_url"]


def save_to_url(
    c: Call, model: Any, url: str, optimizer: Any, overwrite: bool, group: Any
) -> Manifest:
    """``fsdpcheck.save`` to an object store (see NOTE: [saving to object storage]).

    Collective, inside save's call (``dist.runner``); the arguments and errors are those of
    ``fsdpcheck.save``.
    """
    comm = c.comm

    def where() -> RemotePath:
        c.arguments(optimizer=given(optimizer), overwrite=bool(overwrite), url=True)
        root = location(url)
        assert isinstance(root, RemotePath)
        return root

    root = c.local(ARGUMENTS, where)
    groups = c.exchange("agreeing on the URL", str(root))
    if len(groups) > 1:
        raise RuntimeError(
            "fsdpcheck.save: the ranks were given different URLs "
            f"({sorted({g.payload for g in groups})}); every rank must save to the same one"
        )

    def prepare() -> dict[str, Any]:
        optimizers = inner_optimizers(optimizer) if optimizer is not None else []
        empty = [i for i, o in enumerate(optimizers) if not o.state]
        if empty:
            raise ValueError(
                f"the optimizer{'s' if len(optimizers) > 1 else ''} {empty} "
                "have no state (never stepped): saving it would make torch "
                "initialise it; step it first or save without optimizer="
            )
        if comm.rank == 0:
            root.store.refresh(root.key)
            if root.exists():
                if not overwrite:
                    raise FileExistsError(
                        f"{root} holds objects; pass overwrite=True to replace them"
                    )
                root.store.remove(root.key)
        return save_state(model, optimizers)

    state = c.step(f"fsdpcheck.save to {root}", prepare)
    _dcp_save(state, root, group, c)
    reached("state written")
    fps = fingerprint_report(model, optimizer=optimizer, group=group)
    if fps.failure is not None:  # agreed on in the pass: the same on every rank
        fps.failure.raise_()

    def build() -> Manifest | None:
        if comm.rank != 0:
            return None
        from fsdpcheck.sources.dcp.remote import RemoteDCPSource

        source = RemoteDCPSource(root)
        try:
            return build_manifest(source, fps, comm.world, dcp_saves(root, [root]))
        finally:
            source.close()

    built = c.step("building the manifest", build)
    manifest: Manifest = comm.broadcast_object(built, 0, "sending the manifest")

    def publish() -> None:
        if comm.rank == 0:
            data = json.dumps(manifest.to_json(), indent=1).encode()
            root.store.write(f"{root.key}/{MANIFEST_NAME}", data)
            reached("manifest written")

    c.step(f"writing the manifest into {root}", publish)
    return manifest


def _dcp_save(state: dict[str, Any], root: RemotePath, group: Any, c: Call) -> None:
    """DCP's save through its fsspec writer; its failure in one line naming the root cause."""
    from torch.distributed.checkpoint import save as dcp_save

    comm = c.comm
    try:
        with comm.foreign("DCP writing the state"):
            dcp_save(
                state,
                storage_writer=fsspec_writer(str(root)),
                process_group=group,
                no_dist=not comm.enabled,
            )
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, RankStoppedError)):
            raise
        rank, cause = root_cause(exc)
        on = f" on rank {rank}" if rank is not None and comm.world > 1 else ""
        raise RuntimeError(
            f"fsdpcheck.save to {root} failed{on}: {describe_error(cause)} (while DCP wrote the "
            "state; no manifest was written, so no reader takes it for a checked save)"
        ) from None
