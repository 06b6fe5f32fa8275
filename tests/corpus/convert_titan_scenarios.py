"""Models that declare their own conversion, on FSDP2 gloo ranks
(tests/corpus/test_convert_titan.py).

torchtitan 0.3.0's own Llama3 keeps q, k and v in one ``FusedQKVLinear.wqkv`` parameter
(interleaved per kv group); its state-dict hooks split it into ``wq`` / ``wk`` / ``wv``. The
setup trains it one step under FSDP2 with torchtitan's optimizer container, then writes with
torchtitan's own code: a DCP step (``CheckpointManager.save``), its Hugging Face export
(``last_save_in_hf``: ``Llama3StateDictAdapter.to_hf``, q/k rows permuted within each head),
the same export in bf16 (``export_dtype``), and broken exports made by the same adapter on the
gathered state (one element changed, the permutation omitted, gate and up swapped, zeros).
transformers' Mixtral (stacked experts live) is sharded beside it, with its own
``save_pretrained`` files. Nothing is stated to fsdpcheck unless a scenario says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.testing import unchanged
from tests.corpus import bump, set_element
from tests.corpus import convert_libs as cl
from tests.dist_harness import Registry, World
from tests.torchtitan_parts import Stateful, checkpoint_manager, optimizers

REGISTRY = Registry()
scenario = REGISTRY.scenario

H, KV, HD, DIM, LAYERS, VOCAB = 4, 2, 16, 64, 2, 128
#: One element of the HF export's q_proj; wqkv row 75 of layer 1 (kv group 1) holds it.
PLANT = ("model.layers.1.self_attn.q_proj.weight", (45, 5))
FAULTS = ("one_element", "no_permute", "gate_up_swapped", "zeros")


def titan_config() -> Any:
    """A small torchtitan Llama3 config, built by torchtitan's own layer builder (fused QKV)."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return l3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=l3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=l3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=l3._output_linear_init(DIM)
        ),
        layers=l3._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=H, n_kv_heads=KV, hidden_dim=96,
            rope=ComplexRoPE.Config(dim=HD, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )  # fmt: skip


def titan_model(seed: int) -> Any:
    """torchtitan's Llama3 under FSDP2 (each block, then the root), weights from `seed`."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = titan_config().build()
    model.init_states()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    return model


def titan_optimizers(model: Any) -> tuple[Any, Any]:
    return optimizers(model, lr=1e-2, weight_decay=0.1, training_steps=9)


def save_step(model: Any, opts: Any, scheds: Any, root: Path, folder: str, hf: bool,
              dtype: str = "float32") -> Path:  # fmt: skip
    """torchtitan's CheckpointManager: a step folder, or the HF export of the last step."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    manager = checkpoint_manager(
        model, opts, scheds, root / folder, dataloader=Stateful(position=3),
        states={"train_state": Stateful(step=1)},
        sd_adapter=Llama3StateDictAdapter(model.config, None),
        last_save_in_hf=hf, last_save_model_only=hf, export_dtype=dtype,
    )  # fmt: skip
    manager.save(curr_step=1, last_step=hf)
    manager.close()
    return root / folder / "step-1"


def broken_exports(model: Any, root: Path, rank: int) -> dict[str, list[str]]:
    """The HF export broken after torchtitan's own conversion; fault -> the keys it changes.

    The state is gathered the way torchtitan saves it (``model.state_dict()``, through its
    hooks), converted by its adapter on rank 0 and written as safetensors.
    """
    from safetensors.torch import save_file
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}  # fmt: skip
    if rank != 0:
        return {}
    adapter = Llama3StateDictAdapter(model.config, None)
    out: dict[str, list[str]] = {}
    for fault in FAULTS:
        if fault == "no_permute":  # the adapter's own code, minus its permutation
            adapter._permute = lambda w, n_heads_arg, dim1=None, dim2=None: w  # type: ignore
        sd = {k: v.detach().clone() for k, v in adapter.to_hf(dict(full)).items()}
        adapter = Llama3StateDictAdapter(model.config, None)
        layers = range(LAYERS)
        if fault == "one_element":
            sd[PLANT[0]][PLANT[1]] += 1.0
            keys = [PLANT[0]]
        elif fault == "no_permute":
            keys = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers for p in "qk"]
        elif fault == "gate_up_swapped":
            keys = []
            for i in layers:
                g, u = (f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up"))
                sd[g], sd[u] = sd[u], sd[g]
                keys += [g, u]
        else:
            keys = ["model.layers.0.mlp.down_proj.weight"]
            sd[keys[0]] = torch.zeros_like(sd[keys[0]])
        (root / f"hf_{fault}").mkdir()
        save_file({k: v.contiguous() for k, v in sd.items()}, str(root / f"hf_{fault}" /
                                                                  "model.safetensors"))  # fmt: skip
        out[fault] = sorted(keys)
    return out


def plant_source(model: Any) -> tuple[str, tuple[int, ...]]:
    """Where PLANT comes from in the live wqkv: torchtitan's own hook and adapter, run on
    element numbers of a plain copy of the shapes (a pure reference, no fsdpcheck involved).
    """
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    prefix = "layers.1.attention.qkv_linear."
    module = model.get_submodule(prefix.rstrip("."))
    shape = tuple(module.wqkv.weight.shape)
    numbered = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape)
    sd = {prefix + "wqkv.weight": numbered}
    type(module)._split_qkv_on_save(module, sd, prefix, {})
    hf = Llama3StateDictAdapter(model.config, None).to_hf(sd)
    at = int(hf[PLANT[0]][PLANT[1]])
    return prefix + "wqkv.weight", (at // shape[1], at % shape[1])


@dataclass
class Base:
    model: Any
    opts: Any
    mixtral: Any
    mixtral_faults: dict[str, Any]
    faults: dict[str, list[str]]
    source: tuple[str, tuple[int, ...]]


def setup(rank: int, world: int, shared: Path, saved_by: Any) -> tuple[dict, Base]:
    del saved_by
    from torch.distributed.fsdp import fully_shard

    if rank == 0:
        shared.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    model = titan_model(0)
    opts, scheds = titan_optimizers(model)
    sum(p.pow(2).sum() for p in model.parameters()).backward()  # one step, moments non-zero
    opts.step()
    opts.zero_grad()
    scheds.step()
    ckpts = {
        "step": save_step(model, opts, scheds, shared, "titan", hf=False),
        "hf": save_step(model, opts, scheds, shared, "titan_hf", hf=True),
        "hf_bf16": save_step(model, opts, scheds, shared, "titan_bf16", hf=True, dtype="bfloat16"),
    }
    faults = broken_exports(model, shared, rank)
    # Mixtral: rank 0 writes save_pretrained's files (and broken copies) from the same weights.
    mixtral = cl.mixtral(seed=0)
    if rank == 0:
        case = cl.mixtral_case(shared / "mixtral_files")
        meta = {f: [str(p), keys] for f, (p, keys) in case.faults.items()}
        meta["clean"] = [str(case.clean), []]
        (shared / "mixtral.json").write_text(json.dumps({"faults": faults, "mixtral": meta}))
    torch.distributed.barrier()
    written = json.loads((shared / "mixtral.json").read_text())
    for layer in mixtral.model.layers:
        fully_shard(layer)
    fully_shard(mixtral)
    for fault in FAULTS:
        ckpts[f"hf_{fault}"] = shared / f"hf_{fault}"
    base = Base(model, opts, mixtral, written["mixtral"], written["faults"], plant_source(model))
    return ckpts, base


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model, b.mixtral)


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [
            [f.key, f.kind, list(f.max_abs_index) if f.max_abs_index else None, f.rank]
            for f in r.findings
        ],
        "sources": [_source(f) for f in r.findings],
        "keys": [r.keys_a, r.keys_b, r.keys_checked],
        "elements": r.elements_checked,
        "bytes": r.bytes_read,
        "notes": r.notes,
        "text": re.sub(r"read in [0-9.]+ s", "read", str(r)),
    }


def _source(f: Any) -> list[Any] | None:
    return [f.abs_source[0], list(f.abs_source[1])] if f.abs_source else None


def model_only(fp: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in fp.items() if not k.startswith("optim.")}


# ---------------------------------------------------------------------------------------------
@scenario(2, 3)
def titan_verified_nothing_stated(w: World) -> Any:
    """Its own DCP step (model and optimizer) and its HF export: OK with nothing stated."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    m, opts = w.base.model, w.base.opts
    out = {}
    with unchanged(m):
        out["step"] = summary(fsdpcheck.verify(m, w.ckpts["step"], optimizer=opts))
        out["hf"] = summary(fsdpcheck.verify(m, w.ckpts["hf"]))
        adapter = Llama3StateDictAdapter(m.config, None)
        out["hf_adapter"] = summary(fsdpcheck.verify(m, w.ckpts["hf"], convert=adapter))

        # The bf16 export: its cast stated (compared exactly), and not stated (dtype findings).
        def to_hf_bf16(sd: dict) -> dict:
            return {k: v.to(torch.bfloat16) for k, v in adapter.to_hf(sd).items()}

        out["bf16_cast"] = summary(fsdpcheck.verify(m, w.ckpts["hf_bf16"], convert=to_hf_bf16))
        out["bf16_nothing"] = summary(fsdpcheck.verify(m, w.ckpts["hf_bf16"]))
    return out


@scenario(2, 3)
def titan_planted_exports(w: World) -> Any:
    """Each broken export names exactly its keys; one element with its wqkv source and rank."""
    m = w.base.model
    with unchanged(m):
        out = {f: summary(fsdpcheck.verify(m, w.ckpts[f"hf_{f}"])) for f in FAULTS}
    out["expected"] = w.base.faults
    out["source"] = [w.base.source[0], list(w.base.source[1])]
    return out


@scenario(2, 3)
def titan_fingerprints(w: World) -> Any:
    """The FSDP2 model's fingerprints in HF coordinates equal its export's; one planted live
    element changes exactly the one key that holds it (no data moved, nothing gathered)."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    m = w.base.model
    adapter = Llama3StateDictAdapter(m.config, None)
    with unchanged(m):
        own = fsdpcheck.fingerprint(m)
        hf = fsdpcheck.fingerprint(m, convert=adapter)
    step = model_only(fsdpcheck.fingerprint_checkpoint(w.ckpts["step"]))
    export = fsdpcheck.fingerprint_checkpoint(w.ckpts["hf"])
    name, index = w.base.source
    p = m.get_parameter(name)
    old = bump(p, index, 1.0)
    try:
        planted = fsdpcheck.fingerprint(m, convert=adapter)
    finally:
        if old is not None:
            set_element(p, index, old)
    return {
        "own_equals_step": own == step,
        "own_keys": sorted(own),
        "hf_equals_export": hf == export,
        "hf_keys": len(hf),
        "planted_differs": sorted(k for k in export if planted.get(k) != export[k]),
    }


@scenario(2)
def titan_loaded(w: World) -> Any:
    """Its DCP step (with the optimizer) and its HF export loaded into fresh FSDP2 models
    through its declared layouts: the shards written in place, nothing gathered."""
    out: dict[str, Any] = {}
    want = fsdpcheck.fingerprint(w.base.model, optimizer=w.base.opts)
    m = titan_model(seed=1)
    opts, _ = titan_optimizers(m)
    before = fsdpcheck.fingerprint(m)
    r = fsdpcheck.load(m, w.ckpts["step"], optimizer=opts)
    out["step"] = summary(r)
    got = fsdpcheck.fingerprint(m, optimizer=opts)
    out["step_equal"] = [got == want, model_only(before) != model_only(want)]
    m2 = titan_model(seed=2)
    out["hf"] = summary(fsdpcheck.load(m2, w.ckpts["hf"]))
    out["hf_equal"] = fsdpcheck.fingerprint(m2) == model_only(want)
    return out


@scenario(2)
def mixtral_sharded_nothing_stated(w: World) -> Any:
    """transformers' Mixtral under FSDP2 against its own save_pretrained files."""
    m = w.base.mixtral
    files = w.base.mixtral_faults
    out = {}
    with unchanged(m):
        for fault in ("clean", "one_element", "experts_swapped", "gate_up_swapped", "zeros"):
            out[fault] = summary(fsdpcheck.verify(m, files[fault][0]))
    out["expected"] = {f: keys for f, (_, keys) in files.items()}
    return out


@scenario(2)
def titan_resumed_from_its_hf_export(w: World) -> Any:
    """torchtitan's own initial load from its HF export (through its adapter), then
    ``integrations.torchtitan.verify_after_load``: checked through the same adapter."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    from fsdpcheck.integrations.torchtitan import verify_after_load

    m = titan_model(seed=3)
    opts, scheds = titan_optimizers(m)
    cfg = CheckpointManager.Config(
        enable=True, folder="resume", interval=1, initial_load_path=str(w.ckpts["hf"]),
        initial_load_in_hf=True, initial_load_model_only=True,
    )  # fmt: skip
    manager = cfg.build(
        dataloader=None, model_parts=[m], optimizers=opts, lr_schedulers=scheds, states={},
        sd_adapter=Llama3StateDictAdapter(m.config, None), base_folder=str(w.workdir),
    )  # fmt: skip
    loaded = manager.load(step=-1)
    r = verify_after_load(manager)
    manager.close()
    return {
        "loaded": bool(loaded),
        "report": summary(r),
        "equal": fsdpcheck.fingerprint(m) == model_only(fsdpcheck.fingerprint(w.base.model)),
    }
