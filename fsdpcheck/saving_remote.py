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
from fsdpcheck.collectives import Comm, agree, cyclic_gc_paused, distinct
from fsdpcheck.errors import describe_error, root_cause
from fsdpcheck.fingerprints import fingerprint_report
from fsdpcheck.live import inner_optimizers
from fsdpcheck.manifest import MANIFEST_NAME, Manifest
from fsdpcheck.sources.remote import RemotePath, location

__all__ = ["save_to_url"]


def save_to_url(
    model: Any, url: str, *, optimizer: Any = None, overwrite: bool = False, group: Any = None
) -> Manifest:
    """``fsdpcheck.save`` to an object store (see NOTE: [saving to object storage]).

    Collective; the arguments and errors are those of ``fsdpcheck.save``.
    """
    from fsdpcheck.saving import _save_state, _step, build_manifest, dcp_saves

    comm = Comm(group)
    root = location(url)
    assert isinstance(root, RemotePath)
    groups, past = distinct(comm, str(root))
    if len(groups) > 1 or past:
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
        return _save_state(model, optimizers)

    with cyclic_gc_paused():  # NOTE: [cyclic GC] in ``collectives``: objects per key
        state = agree(comm, prepare, f"fsdpcheck.save to {root}")
        _dcp_save(state, root, group, comm)
        _step("state written")
        fps = fingerprint_report(model, optimizer=optimizer, group=group)

        def build() -> Manifest | None:
            if comm.rank != 0:
                return None
            from fsdpcheck.sources.remote_dcp import RemoteDCPSource

            source = RemoteDCPSource(root)
            try:
                return build_manifest(source, fps, comm.world, dcp_saves(root, [root]))
            finally:
                source.close()

        built = agree(comm, build, "building the manifest")
        manifest: Manifest = comm.broadcast_object(built, 0)

        def publish() -> None:
            if comm.rank == 0:
                data = json.dumps(manifest.to_json(), indent=1).encode()
                root.store.write(f"{root.key}/{MANIFEST_NAME}", data)
                _step("manifest written")

        agree(comm, publish, f"writing the manifest into {root}")
        return manifest


def _dcp_save(state: dict[str, Any], root: RemotePath, group: Any, comm: Comm) -> None:
    """DCP's save through its fsspec writer; its failure in one line naming the root cause."""
    from torch.distributed.checkpoint import save as dcp_save

    try:
        dcp_save(
            state,
            storage_writer=fsspec_writer(str(root)),
            process_group=group,
            no_dist=not comm.enabled,
        )
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        lost = comm.lost_rank(exc, "fsdpcheck.save (DCP writing the state)")
        if lost is not None:
            raise lost from None
        rank, cause = root_cause(exc)
        on = f" on rank {rank}" if rank is not None and comm.world > 1 else ""
        raise RuntimeError(
            f"fsdpcheck.save to {root} failed{on}: {describe_error(cause)} (while DCP wrote the "
            "state; no manifest was written, so no reader takes it for a checked save)"
        ) from None
