"""``.metadata`` read and checked once per job, inside gloo ranks (dist_harness), at W = 2 and 4.

Every scenario counts, on its own rank, the calls of what parses ``.metadata``
(``dcp_index.read_parsed``; the safe reader's ``read_dcp_metadata``), of the whole-checkpoint
check (``dcp_index.check``), the opens that trusted another rank's digest, the saved chunks
each local piece was cut against (``verification._along_chunks``) and the DTensor layouts worked
out (``layout._work_out``). They come back under
"rank_local", next to what every rank must agree on (the report). The checkpoint is saved by 4
ranks (W = 2 reads one written by more ranks than it has).
tests/dist/metadata_once/test_metadata_once.py checks them.
"""

from __future__ import annotations

import contextlib
import pickle
import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

import fsdpcheck
from fsdpcheck import layout, saved, verification
from fsdpcheck.sources.dcp import index as dcp_index
from fsdpcheck.sources.dcp import load as safe_reader
from fsdpcheck.sources.dcp import source as dcp
from fsdpcheck.testing import plant
from tests.dist.scale.scale_scenarios import sharded
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario
WORLDS = (2, 4)  # KEYS tensors of 4 rows: saved by 4 ranks, each key has 4 chunks


@dataclass
class Base:
    model: nn.Module


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    """World 4 saves "saved" (4 chunks a key); world 2 reads it."""
    model = sharded()
    if saved_by is None:
        path = shared / "saved"
        fsdpcheck.save(model, path)
    else:
        path = Path(saved_by) / "saved"
    return {"saved": path}, Base(model)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model,)
REGISTRY.saved_by_world = 4


@contextlib.contextmanager
def _wrapped(owner: Any, name: str, seen: Callable[..., None]) -> Iterator[None]:
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = None
        try:
            out = fn(*args, **kwargs)
            return out
        finally:  # a call that raised is counted too (`out` None)
            seen(out, *args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, fn)


def counted(fn: Callable[[], Any]) -> dict[str, Any]:
    """What `fn` returns (a Report, or the one-line error it raised), and this rank's counts."""
    n: dict[str, Any] = {"parses": 0, "dcp_parses": 0, "checks": 0, "trusted": 0, "cuts": []}
    n["layouts"] = 0

    def parsed(*_: Any, **__: Any) -> None:
        n["parses"] += 1

    def dcp_parsed(*_: Any, **__: Any) -> None:
        n["dcp_parses"] += 1

    def checked(*_: Any, **__: Any) -> None:
        n["checks"] += 1

    def opened(out: Any, *_: Any, trusted_digest: Any = None, **__: Any) -> None:
        n["trusted"] += trusted_digest is not None and out is not None and out[1] is None

    def worked_out(*_: Any, **__: Any) -> None:
        n["layouts"] += 1

    def cut(out: Any, offset: Any, size: Any, saved: Any) -> None:
        n["cuts"].append(len(saved))

    dist.barrier()
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_wrapped(dcp_index, "read_parsed", parsed))
        stack.enter_context(_wrapped(safe_reader, "read_dcp_metadata", dcp_parsed))
        stack.enter_context(_wrapped(saved, "read_dcp_metadata", dcp_parsed))
        stack.enter_context(_wrapped(dcp_index, "check", checked))
        stack.enter_context(_wrapped(dcp, "open_index", opened))
        stack.enter_context(_wrapped(verification, "_along_chunks", cut))
        stack.enter_context(_wrapped(layout, "_work_out", worked_out))
        try:
            value = fn()
        except Exception as exc:
            result["raised"] = f"{type(exc).__name__}: {exc}"
        else:
            result["ok"] = value.ok
            result["keys_checked"] = value.keys_checked
            result["findings"] = [
                (f.key, f.kind, f.rank, list(f.max_abs_index or ()), f.message)
                for f in value.findings
            ]
    result["rank_local"] = n
    return result


def _verify(w: World, path: Path) -> dict[str, Any]:
    return counted(lambda: fsdpcheck.verify(w.base.model, path))


# -------------------------------------------------------------------------------------------
@scenario(*WORLDS)
def verify_clean(w: World) -> Any:
    layout._PLACED.clear()  # every key's (mesh, placements, shape) worked out afresh
    return _verify(w, w.ckpts["saved"])


@scenario(*WORLDS)
def verify_planted(w: World) -> Any:
    with plant(w.base.model.get_parameter("p.2"), 0, on_rank=1):
        return _verify(w, w.ckpts["saved"])


@scenario(*WORLDS)
def load_full(w: World) -> Any:
    model = sharded(seed=1)
    return counted(lambda: fsdpcheck.load(model, w.ckpts["saved"], verify="full"))


@scenario(*WORLDS)
def load_fingerprint(w: World) -> Any:
    model = sharded(seed=1)
    return counted(lambda: fsdpcheck.load(model, w.ckpts["saved"], verify="fingerprint"))


@scenario(*WORLDS)
def differs_on_one_rank(w: World) -> Any:
    """Each rank its own copy; rank 1's ``.metadata`` is the same metadata in other bytes."""
    import shutil

    mine = w.workdir / f"rank{w.rank}"
    shutil.copytree(w.ckpts["saved"], mine)
    if w.rank == 1:
        meta = mine / ".metadata"
        data = meta.read_bytes()
        meta.write_bytes(pickletools.optimize(data))  # no PUTs unused: other bytes, same content
        assert meta.read_bytes() != data and pickle.loads(meta.read_bytes()) is not None
    w.barrier()
    with plant(w.base.model.get_parameter("p.2"), 0, on_rank=1):
        return _verify(w, mine)


@scenario(*WORLDS)
def storage_damaged(w: World) -> Any:
    """A data file truncated: rank 0's check finds it, every rank reports it the same."""
    path = w.copy("saved")
    if w.rank == 0:
        with open(path / "__1_0.distcp", "r+b") as f:
            f.truncate(10)
    w.barrier()
    verified = _verify(w, path)
    loaded = counted(lambda: fsdpcheck.load(sharded(seed=1), path, verify="full"))
    return {"verify": verified, "load": loaded, "path": str(path)}


@scenario(*WORLDS)
def metadata_broken(w: World) -> Any:
    """``.metadata`` cut short: the same one-line error on every rank, parsed by rank 0 only."""
    path = w.copy("saved")
    if w.rank == 0:
        data = (path / ".metadata").read_bytes()
        (path / ".metadata").write_bytes(data[: len(data) // 2])
    w.barrier()
    verified = _verify(w, path)
    loaded = counted(lambda: fsdpcheck.load(sharded(seed=1), path, verify="full"))
    return {"verify": verified, "load": loaded, "path": str(path)}
