"""Failures on some ranks only, run inside gloo ranks (dist_harness): one verdict everywhere.

Each scenario returns what every rank saw; the harness checks that every rank returned the same
(entries named "rank_local" aside), so a rank that raised while another went on, or two ranks
with different messages, fail the scenario's test.
"""

from __future__ import annotations

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
