"""verify and fingerprint through a conversion on FSDP2 gloo ranks
(tests/dist/convert/test_convert_dist.py).

The live model is in the source layout of ``tests/convert_cases`` (torchtitan's kind), sharded
with FSDP2; the reference files are what the conversion writes from the same values (Hugging
Face's kind), clean and with planted conversion bugs. On 3 ranks the shards cut heads (32 rows:
11, 11, 10) and the k/v boundary of the fused ``wkv`` falls inside rank 1's shard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import fsdpcheck
from fsdpcheck.testing import unchanged
from tests import convert_cases as cc
from tests.corpus import bump, set_element
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario
WAYS = {"callable": cc.to_hf, "adapter": cc.Adapter(), "spec": cc.SPEC}


class _Holder(nn.Module):
    """A module holding parameters under given dotted names (the source layout's)."""


def source_model(seed: int = 0) -> nn.Module:
    """A module whose state dict is ``convert_cases.source_state(seed)``, names and values."""
    return holder(cc.source_state(seed))


def fully_sharded(seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = source_model(seed)
    for layer in model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


@dataclass
class Base:
    model: nn.Module


def holder(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose state dict is `state` (names and values)."""
    root = _Holder()
    for name, value in state.items():
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, _Holder())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(value.clone()))
    return root


def setup(rank: int, world: int, shared: Path, saved_by: Any) -> tuple[dict, Base]:
    del saved_by
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    ckpts = {}
    files = {"clean": cc.converted(cc.source_state())}
    files["bf16"] = cc.converted(cc.source_state(), cc.to_hf_bf16)
    for fault in [*cc.FAULTS, "one_element"]:
        files[fault] = cc.faulty(fault)
    for name, sd in files.items():
        path = shared / f"{name}.safetensors"
        if rank == 0:
            shared.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
        ckpts[name] = path
    torch.distributed.barrier()
    model = fully_sharded()
    # Both layouts saved by the ranks as sharded DCP (chunks cut where FSDP2 cut the shards).
    hf = holder(cc.converted(cc.source_state()))
    fully_shard(hf)
    ckpts["hf_dcp"] = shared / "hf_dcp"
    dcp.save(hf.state_dict(), checkpoint_id=str(ckpts["hf_dcp"]))
    ckpts["src_dcp"] = shared / "src_dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(ckpts["src_dcp"]))
    return ckpts, Base(model)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model,)


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [
            [f.key, f.kind, list(f.max_abs_index) if f.max_abs_index else None, f.rank]
            for f in r.findings
        ],
        "sources": [list(f.abs_source) if f.abs_source else None for f in r.findings],
        "keys": [r.keys_a, r.keys_b, r.keys_checked],
        "elements": r.elements_checked,
        "bytes": r.bytes_read,
        # The time of a per-rank (offline) check differs between ranks: not part of the verdict.
        "text": re.sub(r"read in [0-9.]+ s", "read", str(r)),
    }


# ---------------------------------------------------------------------------------------------
@scenario(2, 3)
def verify_through_conversion(w: World) -> Any:
    """Clean OK stated each way; under a small budget too; the bf16 export with its cast."""
    m = w.base.model
    out = {}
    with unchanged(m):
        for way, conv in WAYS.items():
            out[way] = summary(fsdpcheck.verify(m, w.ckpts["clean"], convert=conv))
        out["small_budget"] = summary(
            fsdpcheck.verify(m, w.ckpts["clean"], convert=cc.SPEC, memory_budget=700)
        )
        out["bf16"] = summary(fsdpcheck.verify(m, w.ckpts["bf16"], convert=cc.to_hf_bf16))
        out["bf16_without_cast"] = summary(fsdpcheck.verify(m, w.ckpts["bf16"], convert=cc.to_hf))
        out["no_convert"] = summary(fsdpcheck.verify(m, w.ckpts["clean"]))
    return out


@scenario(2, 3)
def verify_planted_conversion_bugs(w: World) -> Any:
    """Each planted bug names exactly its keys; one element with its source index and rank."""
    m = w.base.model
    out = {}
    with unchanged(m):
        for fault in [*cc.FAULTS, "one_element"]:
            out[fault] = {
                way: summary(fsdpcheck.verify(m, w.ckpts[fault], convert=conv))
                for way, conv in WAYS.items()
            }
    return out


@scenario(2, 3)
def fingerprint_through_conversion(w: World) -> Any:
    """The live FSDP2 model's fingerprints in HF coordinates equal the converted file's."""
    m = w.base.model
    out: dict[str, Any] = {}
    with unchanged(m):
        for name, fn in (("clean", cc.to_hf), ("bf16", cc.to_hf_bf16)):
            live = fsdpcheck.fingerprint(m, convert=fn)
            out[name] = live == fsdpcheck.fingerprint_checkpoint(w.ckpts[name])
            out[name + "_keys"] = len(live)
        out["spec_equal"] = fsdpcheck.fingerprint(m, convert=cc.SPEC) == fsdpcheck.fingerprint(
            m, convert=cc.to_hf
        )
    file = fsdpcheck.fingerprint_checkpoint(w.ckpts["clean"])
    # One planted live element changes exactly the one converted key that holds it.
    p = m.get_parameter("layers.1.attention.wq.weight")
    old = bump(p, (19, 5))
    try:
        planted = fsdpcheck.fingerprint(m, convert=cc.to_hf)
    finally:
        if old is not None:
            set_element(p, (19, 5), old)
    out["planted_differs"] = sorted(k for k in file if planted.get(k) != file[k])
    return out


@scenario(2, 3)
def sharded_files_on_both_sides(w: World) -> Any:
    """Both layouts as sharded DCP: verify, compare and fingerprints through the conversion."""
    m = w.base.model
    out: dict[str, Any] = {}
    with unchanged(m):
        out["verify"] = summary(fsdpcheck.verify(m, w.ckpts["hf_dcp"], convert=cc.Adapter()))
        live = fsdpcheck.fingerprint(m, convert=cc.to_hf)
    out["compare"] = summary(
        fsdpcheck.compare_checkpoints(
            w.ckpts["src_dcp"], w.ckpts["hf_dcp"], convert=cc.SPEC, memory_budget=1500
        )
    )
    hf = fsdpcheck.fingerprint_checkpoint(w.ckpts["hf_dcp"])
    out["fingerprints_equal"] = [
        hf == live,
        hf == fsdpcheck.fingerprint_checkpoint(w.ckpts["src_dcp"], convert=cc.to_hf),
    ]
    return out
