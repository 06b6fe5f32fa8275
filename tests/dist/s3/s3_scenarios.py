"""Checkpoints in object storage on FSDP2 ranks, inside gloo ranks (dist_harness, world 2).

The setup trains an FSDP2 model and saves it with DCP's FsspecWriter into the test's S3 server
(moto, tests/s3_server.py: the ``s3_server`` fixture, started before the ranks) and with DCP's
FileSystemWriter on local disk. Each rank reads through its own port of the test proxy, so the
proxy's log of that port is what this rank fetched (``own_log``): the scenarios return it, and
the tests check that a rank fetched only byte ranges inside the chunks it needs.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import fsdpcheck
from fsdpcheck import offline_dist
from fsdpcheck import testing as T
from fsdpcheck._compat import fsspec_writer, is_dtensor, local_shape_and_offset
from fsdpcheck.cli import main
from fsdpcheck.testing import plant, train, unchanged
from tests.dist_harness import Registry, World
from tests.s3_server import object_key, own_log

# Tensors large enough that a chunk's data is most of its blob (the header is ~1 KB).
Net = functools.partial(T.TinyTransformer, vocab=64, dim=48, hidden=96, out=10)

REGISTRY = Registry()
scenario = REGISTRY.scenario


@dataclass
class Base:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    endpoint: str  # this rank's port of the proxy


def _config() -> dict[str, Any] | None:
    text = os.environ.get("FSDPCHECK_TEST_S3")
    return json.loads(text) if text else None


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base | None]:
    del saved_by
    cfg = _config()
    if cfg is None:  # no server in this session: the tests of this module skip
        return {}, None
    endpoint = cfg["proxy"][1 + rank]
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # this rank's reads go through its own port
    model, opt = T.build("fsdp", world, seed=0, model_cls=Net)
    train(model, opt, vocab=64)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    run = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(run, 0)
    prefix = f"s3://{cfg['bucket']}/dist-{run[0]}"
    # Written straight into moto (the proxy's log is for what is read).
    dcp.save(sd, storage_writer=fsspec_writer(f"{prefix}/ckpt", endpoint_url=cfg["moto"]))
    dcp.save(sd, checkpoint_id=str(shared / "local"))
    dist.barrier()
    ckpts = {"url": f"{prefix}/ckpt", "prefix": prefix, "local": shared / "local"}
    return ckpts, Base(model, opt, endpoint)


REGISTRY.setup = setup
REGISTRY.base_state = lambda base: () if base is None else (base.model, base.opt)


def _report(r: fsdpcheck.Report) -> dict[str, Any]:
    d = r.to_dict()
    d.pop("seconds")
    d["text"] = str(r).split("\n", 1)[-1]
    return d


def _gets(log: list[dict[str, Any]]) -> list[list[Any]]:
    """The GETs of a rank's log: [object, first byte, last byte, bytes answered, status]."""
    out = []
    for e in log:
        if e["method"] != "GET" or "?" in e["path"]:
            continue  # listings
        lo, hi = (int(x) for x in e["range"].split("=")[1].split("-")) if e["range"] else (0, -1)
        out.append([object_key(e["path"]), lo, hi, e["nbytes"], e["status"]])
    return out


def _needed(url: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[Any]]:
    """The storage entries this rank must read to check its shards: [object, start, end).

    Per live tensor, the saved chunks its box (this rank's shard) overlaps; per value
    (hyperparameters), its entry. From the checkpoint's own metadata.
    """
    from fsdpcheck.reading.references import open_source

    msd, osd = get_state_dict(model, opt)
    flat: dict[str, Any] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, list):
            flat[prefix] = x  # a list of values is one entry; of tensors, one each
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = x

    walk("", {"model": msd, "optim": osd})
    src = open_source(url)
    try:
        idx = src.index  # type: ignore[attr-defined]
        root = object_key(url.split("://", 1)[1])
        out = set()
        for key, value in flat.items():
            if key not in idx.key_id:
                continue
            if not isinstance(value, torch.Tensor):
                e = idx.value_entry[key]
            else:
                if is_dtensor(value):
                    shape, offset = local_shape_and_offset(
                        value.shape, value.device_mesh, value.placements
                    )
                else:
                    shape, offset = tuple(value.shape), (0,) * value.dim()
                for i in idx.overlapping(key, offset, shape):
                    rel, start, length, _ = idx.storage(idx.chunk_entry(key, i))
                    out.add((f"{root}/{rel}", start, start + length))
                continue
            rel, start, length, _ = idx.storage(e)
            out.add((f"{root}/{rel}", start, start + length))
    finally:
        src.close()
    return sorted([list(x) for x in out])


def _verify(w: World, model: Any, **kw: Any) -> dict[str, Any]:
    with unchanged(model, w.base.opt):
        return _report(fsdpcheck.verify(model, w.ckpts["url"], optimizer=w.base.opt, **kw))


# -- verify ---------------------------------------------------------------------------------------
@scenario(2)
def verify_clean(w: World) -> dict[str, Any]:
    """verify against s3://, and what this rank fetched against what it needs."""
    own_log(w.base.endpoint)
    r = _verify(w, w.base.model)
    fetched = _gets(own_log(w.base.endpoint))
    needed = _needed(w.ckpts["url"], w.base.model, w.base.opt)
    own_log(w.base.endpoint)
    return {"report": r, "rank_local": {"fetched": fetched, "needed": needed}}


@scenario(2)
def verify_planted(w: World) -> dict[str, Any]:
    with plant(w.base.model.get_parameter("blocks.1.w1.weight"), (3, 7), delta=0.5, on_rank=1):
        return _verify(w, w.base.model)


@scenario(2)
def verify_local_same_as_s3(w: World) -> dict[str, Any]:
    """The same verdict and counts from the local copy and from the store."""
    with unchanged(w.base.model, w.base.opt):
        local = _report(fsdpcheck.verify(w.base.model, w.ckpts["local"], optimizer=w.base.opt))
    remote = _verify(w, w.base.model)
    keys = ("ok", "keys_checked", "elements_checked", "findings")
    return {"local": {k: local[k] for k in keys}, "s3": {k: remote[k] for k in keys}}


# -- load and save --------------------------------------------------------------------------------
@scenario(2)
def load_from_s3(w: World) -> dict[str, Any]:
    fresh, fopt = T.build("fsdp", w.size, seed=1, model_cls=Net)
    train(fresh, fopt, steps=1, vocab=64)
    r = fsdpcheck.load(fresh, w.ckpts["url"], optimizer=fopt)
    with unchanged(fresh, fopt):
        again = fsdpcheck.verify(fresh, w.ckpts["local"], optimizer=fopt)
    return {"load": _report(r), "verify_local": _report(again)}


@scenario(2)
def save_to_s3_then_audit_deep(w: World) -> dict[str, Any]:
    url = f"{w.ckpts['prefix']}/saved"
    with unchanged(w.base.model, w.base.opt):
        manifest = fsdpcheck.save(w.base.model, url, optimizer=w.base.opt)
    deep = fsdpcheck.audit(url, deep=True)  # every rank, alone
    with unchanged(w.base.model, w.base.opt):
        loaded = fsdpcheck.verify(w.base.model, url, optimizer=w.base.opt)
    return {
        "world_size": manifest.world_size,
        "entries": len(manifest.entries),
        "fingerprinted": len(manifest.fingerprints()),
        "audit": {"ok": deep.ok, "findings": deep.to_dict()["findings"], "notes": deep.notes},
        "verify": _report(loaded),
    }


# -- offline commands spread over the ranks -------------------------------------------------------
@scenario(2)
def fingerprint_split_over_ranks(w: World) -> dict[str, Any]:
    """``torchrun -m fsdpcheck fingerprint s3://...``: each process reads its share only."""
    from fsdpcheck.fingerprints import fingerprint_checkpoint

    alone = fingerprint_checkpoint(w.ckpts["local"])
    own_log(w.base.endpoint)
    with offline_dist.session():
        together = fingerprint_checkpoint(w.ckpts["url"], memory_budget=16 << 10)
        code = main(["compare", w.ckpts["url"], str(w.ckpts["local"]), "--memory-budget", "16K"])
    fetched = _gets(own_log(w.base.endpoint))
    return {
        "same": {k: f"{v:#x}" for k, v in together.items()}
        == {k: f"{v:#x}" for k, v in alone.items()},
        "compare_exit": code,
        "rank_local": {"fetched": fetched},
    }
