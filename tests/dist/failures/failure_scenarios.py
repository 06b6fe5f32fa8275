"""Failures on some ranks only, run inside gloo ranks (dist_harness): one verdict everywhere.

Each scenario returns what every rank saw; the harness checks that every rank returned the same
(entries named "rank_local" aside), so a rank that raised while another went on, or two ranks
with different messages, fail the scenario's test.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.testing import small_model
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Any]:
    return {}, None


REGISTRY.setup = setup


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # the type and the one line every rank must agree on
        return f"{type(exc).__name__}: {exc}"
    return None


def _saved(w: World, name: str = "ck") -> Path:
    m, opt = small_model()
    fsdpcheck.save(m, w.workdir / name, optimizer=opt)
    return w.workdir / name


# ---------------------------------------------------------------------------------------------
@scenario(2)
def load_with_a_different_kind_per_rank(w: World) -> Any:
    """Rank 0 a full .pt, rank 1 a DCP directory (before: the rank that did not raise hung)."""
    ck = _saved(w)
    full = w.workdir / "full.pt"
    if w.rank == 0:
        m, _ = small_model()
        torch.save(m.state_dict(), full)
    w.barrier()
    path = full if w.rank == 0 else ck
    m2, opt2 = small_model(seed=1)
    before = fsdpcheck.fingerprint(m2, optimizer=opt2)
    out = {
        "plain": _error_of(lambda: fsdpcheck.load(m2, path, optimizer=opt2)),
        "expect_sharded": _error_of(lambda: fsdpcheck.load(m2, path, expect="sharded")),
    }
    out["untouched"] = fsdpcheck.fingerprint(m2, optimizer=opt2) == before
    out["paths"] = [str(full), str(ck)]
    return out


@scenario(2)
def load_copies_of_one_checkpoint_from_different_paths(w: World) -> Any:
    """Node-local copies of one checkpoint: allowed, loaded, checked."""
    ck = _saved(w)
    if w.rank == 1:
        shutil.copytree(ck, w.workdir / "copy")
    w.barrier()
    m2, opt2 = small_model(seed=1)
    r = fsdpcheck.load(m2, ck if w.rank == 0 else w.workdir / "copy", optimizer=opt2)
    m, opt = small_model()
    return {
        "ok": r.ok,
        "same_state": fsdpcheck.fingerprint(m2, optimizer=opt2)
        == fsdpcheck.fingerprint(m, optimizer=opt),
        "rank_local": str(r),
    }


@scenario(2)
def a_failed_dcp_read_inside_load(w: World) -> Any:
    """A chunk that no longer unpickles: the same one line on every rank, naming file and key."""
    ck = _saved(w)
    w.barrier()
    f = sorted(ck.glob("*.distcp"))[0]
    if w.rank == 0:
        data = bytearray(f.read_bytes())
        data[:4] = b"XXXX"
        f.write_bytes(bytes(data))
    w.barrier()
    m2, opt2 = small_model(seed=1)
    return {"error": _error_of(lambda: fsdpcheck.load(m2, ck, optimizer=opt2)), "file": str(f)}


@scenario(2)
def save_through_a_symlink(w: World) -> Any:
    """Every rank writes through the link into the directory it leads to; the link stays."""
    real = _saved(w, "v1")
    link = w.workdir / "ck"
    if w.rank == 0:
        link.symlink_to(real)
    w.barrier()
    m, opt = small_model(seed=1)
    fsdpcheck.save(m, link, optimizer=opt, overwrite=True)
    return {
        "link": link.is_symlink() and link.resolve() == real,
        "new": fsdpcheck.fingerprint_checkpoint(link) == fsdpcheck.fingerprint(m, optimizer=opt),
        "beside": sorted(p.name for p in w.workdir.iterdir()),
        "refused": _error_of(lambda: fsdpcheck.save(m, link, optimizer=opt)),
    }


class _Bomb(io.RawIOBase):
    """Zeros without end: what a stream.zstd entry of a few hundred bytes can inflate to."""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        b[:] = bytes(len(b))
        return len(b)


@scenario(2)
def load_refused_on_one_rank_writes_on_none(w: World) -> Any:
    """A decompression bomb in a chunk only rank 1 reads, the last it reads: no rank writes.

    Before, rank 0 loaded all of its shards and rank 1 all but the last, then both raised: a
    model half old, half new. Now every rank checks all it will read, they agree, and nothing
    is written anywhere (the sentinels of sentinel=True included).
    """
    from torch.distributed.checkpoint import filesystem

    from tests.dist.scale.scale_scenarios import sharded

    ck = w.workdir / "bombed"
    fsdpcheck.save(sharded(), ck)
    w.barrier()
    if w.rank == 0:
        md = pickle.loads((ck / ".metadata").read_bytes())
        mine = [(i.offset, x.fqn) for x, i in md.storage_data.items()
                if i.relative_path.startswith("__1_") and x.fqn.startswith("model.")]  # fmt: skip
        last = max(mine)[1]
        for x, i in md.storage_data.items():
            if x.fqn == last and i.relative_path.startswith("__1_"):
                i.transform_descriptors = ["stream.zstd/1"]
        (ck / ".metadata").write_bytes(pickle.dumps(md))
    w.barrier()
    real = filesystem._StorageReaderTransforms.transform_load_stream
    filesystem._StorageReaderTransforms.transform_load_stream = (  # type: ignore[method-assign]
        lambda self, req, descriptors, stream: io.BufferedReader(_Bomb())
    )
    try:
        out: dict[str, Any] = {}
        for sentinel in (False, True):
            m2 = sharded(seed=1)
            before = fsdpcheck.fingerprint(m2)
            error = _error_of(lambda m2=m2, s=sentinel: fsdpcheck.load(m2, ck, sentinel=s))
            out[f"sentinel={sentinel}"] = {
                "error": error,
                "untouched": fsdpcheck.fingerprint(m2) == before,
            }
    finally:
        filesystem._StorageReaderTransforms.transform_load_stream = real  # type: ignore[method-assign]
    out["ck"] = str(ck)
    return out
