"""Conversions made by the libraries' own conversion code at test time (test_convert_libs.py).

Each builder makes a small random model with the library's own classes, writes the converted
checkpoint with the library's own converter or checkpointer, and returns a ``LibCase``: the live
model, the conversion as the library states it (its own function; nothing for a model that
declares its own), the clean checkpoint, and faulty copies of it. A fault is planted AFTER the
library's conversion, in the file it wrote, as a broken converter would have written it (one
element changed, the q/k permutation omitted, gate and up swapped, a tensor written as zeros,
two experts swapped, q/k/v fused in the wrong order), each with the exact keys it must name.

Where a fault is "the converter forgot a step", the file is written by the library's own
functions minus that step (torchtune's key mapping without its permutation), never by a
hand-made imitation of the library's layout.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Sizes of every small model here: 4 heads of 8 (2 kv heads), 2 layers, MLP 48, vocab 64.
H, KV, HD, DIM, FF, LAYERS, VOCAB = 4, 2, 8, 32, 48, 2, 64


@dataclass
class LibCase:
    """One library's conversion and the checkpoints its code wrote.

    Attributes:
        name: The library and the conversion.
        live: The model in the library's live layout (what ``verify`` gets).
        convert: The conversion as ``convert=`` takes it (None: the model declares its own).
        clean: The checkpoint the library's code wrote.
        faults: Fault name -> (the faulty checkpoint, the exact keys it must name).
        plant: (key, index) of the one element changed in ``faults["one_element"]``.
        source: (live key, index) that element is converted from.
        original: The checkpoint the library converted from, where there is one.
    """

    name: str
    live: Any
    convert: Any
    clean: Path
    faults: dict[str, tuple[Path, list[str]]] = field(default_factory=dict)
    plant: tuple[str, tuple[int, ...]] = ("", ())
    source: tuple[str, tuple[int, ...]] = ("", ())
    original: Path | None = None


def hf_llama(seed: int = 0) -> Any:
    """A small transformers Llama (its own class), weights depending on `seed` only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=KV,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


# -------------------------------------------------------------------------------------------
# Faults, planted in what the converter wrote.
def read_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or a torch.save file (weights only)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return dict(sd.get("model", sd))


def write_like(src: Path, dst: Path, sd: dict[str, torch.Tensor]) -> Path:
    """`sd` written in `src`'s format (and folder, if `src` is a file in one), at `dst`."""
    if src.is_dir():
        shutil.copytree(src, dst)
        (file,) = [p for p in dst.iterdir() if p.suffix in (".safetensors", ".pth", ".bin")]
        write_like(file, file, sd)
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous().clone() for k, v in sd.items()}
    if src.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(dst))
    else:
        torch.save(sd, dst)
    return dst


def weights_file(path: Path) -> Path:
    """The one weights file of a checkpoint folder (or the file itself)."""
    if path.is_file():
        return path
    (file,) = [p for p in path.iterdir() if p.suffix in (".safetensors", ".pth", ".bin")]
    return file


def faulty(case: LibCase, fault: str, change: Callable[[dict], list[str]], root: Path) -> None:
    """A copy of the clean checkpoint with `change` applied; `change` returns the keys hit."""
    sd = read_file(weights_file(case.clean))
    keys = change(sd)
    dst = root / f"{case.name}-{fault}"
    dst = dst if case.clean.is_dir() else dst.with_suffix(case.clean.suffix)
    case.faults[fault] = (write_like(case.clean, dst, sd), sorted(keys))


def plant_one(case: LibCase, key: str, index: tuple[int, ...], root: Path) -> None:
    """The "one_element" fault: one element of `key` changed by +1 after the conversion."""

    def change(sd: dict) -> list[str]:
        sd[key] = sd[key].clone()
        sd[key][index] += 1.0
        return [key]

    faulty(case, "one_element", change, root)
    case.plant = (key, index)


def zeros(case: LibCase, key: str, root: Path) -> None:
    """The "zeros" fault: `key` written as zeros."""

    def change(sd: dict) -> list[str]:
        sd[key] = torch.zeros_like(sd[key])
        return [key]

    faulty(case, "zeros", change, root)


def swapped(case: LibCase, fault: str, pairs: list[tuple[str, str]], root: Path) -> None:
    """Each pair of keys written with the other's values (gate/up, two experts)."""

    def change(sd: dict) -> list[str]:
        for a, b in pairs:
            sd[a], sd[b] = sd[b], sd[a]
        return [k for ab in pairs for k in ab]

    faulty(case, fault, change, root)


def source_of(convert: Callable[[dict], dict], sources: dict[str, torch.Tensor], key: str,
              index: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:  # fmt: skip
    """Where the converter takes one target element from: a pure reference.

    The converter runs on tensors holding their own element numbers (one range over all the
    sources), so the target element's value says which source element it is.
    """
    numbered: dict[str, torch.Tensor] = {}
    start = 0
    owner = []
    for name, t in sources.items():
        n = t.numel()
        numbered[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(t.shape)
        owner.append((start, name, tuple(t.shape)))
        start += n
    at = int(convert(numbered)[key][index].item())
    first, name, shape = max((o for o in owner if o[0] <= at), key=lambda o: o[0])
    return name, tuple(int(i) for i in torch.unravel_index(torch.tensor(at - first), shape))


# -------------------------------------------------------------------------------------------
def torchtune_hf(root: Path) -> LibCase:
    """torchtune's FullModelHFCheckpointer round trip: HF -> torchtune model -> HF files.

    The live model is torchtune's own Llama 3 (``attn.q_proj``, ``mlp.w1``, ``sa_norm.scale``),
    loaded by the checkpointer (``hf_to_tune``); the files are what its ``save_checkpoint``
    writes (``convert_weights.tune_to_hf``: renames and the RoPE permutation of q and k).
    """
    from torchtune.models import convert_weights
    from torchtune.models.llama3 import llama3
    from torchtune.training import FullModelHFCheckpointer

    hf_llama().save_pretrained(root / "tune_hf_in")
    ck = FullModelHFCheckpointer(
        checkpoint_dir=str(root / "tune_hf_in"),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3",
        output_dir=str(root / "tune_hf_out"),
    )
    model = llama3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=H, num_kv_heads=KV,
                   embed_dim=DIM, max_seq_len=64, intermediate_dim=FF)  # fmt: skip
    model.load_state_dict(ck.load_checkpoint()["model"])
    ck.save_checkpoint({"model": model.state_dict()}, epoch=0)
    to_hf = functools.partial(convert_weights.tune_to_hf, num_heads=H, num_kv_heads=KV, dim=DIM)
    case = LibCase("torchtune-hf", model, to_hf, root / "tune_hf_out" / "epoch_0")
    q = "model.layers.1.self_attn.q_proj.weight"
    plant_one(case, q, (21, 5), root)
    case.source = source_of(to_hf, dict(model.state_dict()), q, (21, 5))
    layers = range(LAYERS)

    def no_permute(sd: dict) -> list[str]:
        # torchtune's own key mapping, without its permutation: what a converter that
        # forgot it writes.
        inverted = {v: k for k, v in convert_weights._FROM_HF.items()}
        for k, v in model.state_dict().items():
            if "q_proj" in k or "k_proj" in k:
                sd[convert_weights.get_mapped_key(k, inverted)] = v.detach().clone()
        return [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers for p in "qk"]

    faulty(case, "no_permute", no_permute, root)
    pairs = [(f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight")
             for i in layers]  # fmt: skip
    swapped(case, "gate_up_swapped", pairs, root)
    zeros(case, "model.layers.0.mlp.down_proj.weight", root)
    return case


def torchtune_meta(root: Path, model: Any) -> LibCase:
    """torchtune's FullModelMetaCheckpointer: the Meta layout (renames only, no permutation).

    The Meta checkpoint is written by torchtune's own ``tune_to_meta`` and read back and saved
    again by the checkpointer (``meta_to_tune`` / ``tune_to_meta``).
    """
    from torchtune.models import convert_weights
    from torchtune.training import FullModelMetaCheckpointer

    src = root / "tune_meta_in"
    src.mkdir()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = convert_weights.tune_to_meta(sd)
    # Meta's checkpoints hold the RoPE frequencies too; torchtune's meta_to_tune skips them.
    meta["rope.freqs"] = 1.0 / (500000.0 ** (torch.arange(0, HD, 2).float() / HD))
    torch.save(meta, src / "consolidated.00.pth")
    ck = FullModelMetaCheckpointer(
        checkpoint_dir=str(src),
        checkpoint_files=["consolidated.00.pth"],
        model_type="LLAMA3",
        output_dir=str(root / "tune_meta_out"),
    )
    model.load_state_dict(ck.load_checkpoint()["model"])
    ck.save_checkpoint({"model": model.state_dict()}, epoch=0)
    (file,) = (root / "tune_meta_out" / "epoch_0").glob("model-*.bin")
    case = LibCase("torchtune-meta", model, convert_weights.tune_to_meta, file)
    case.original = src / "consolidated.00.pth"
    plant_one(case, "layers.0.attention.wk.weight", (3, 7), root)
    case.source = ("layers.0.attn.k_proj.weight", (3, 7))
    swapped(case, "gate_up_swapped", [(f"layers.{i}.feed_forward.w1.weight",
                                      f"layers.{i}.feed_forward.w3.weight")
                                     for i in range(LAYERS)], root)  # fmt: skip
    zeros(case, "tok_embeddings.weight", root)
    return case


# -------------------------------------------------------------------------------------------
def litgpt_config() -> Any:
    """litgpt's Config of the small Llama (its own class, the Llama 2 family's settings)."""
    from litgpt import Config

    return Config.from_name(
        "Llama-2-7b-hf", n_layer=LAYERS, n_embd=DIM, n_head=H, n_query_groups=KV,
        intermediate_size=FF, padded_vocab_size=VOCAB, vocab_size=VOCAB, block_size=64,
    )  # fmt: skip


def litgpt_hf_to_lit(config: Any) -> Callable[[dict], dict]:
    """litgpt's own ``copy_weights_hf_llama`` (what ``convert_hf_checkpoint`` runs) as F(sd)."""
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama

    def hf_to_lit(sd: dict) -> dict:
        out: dict = {}
        copy_weights_hf_llama(config, {}, out, dict(sd))
        return out

    return hf_to_lit


def litgpt_lit_to_hf(config: Any) -> Callable[[dict], dict]:
    """litgpt's own ``copy_weights_llama`` (what ``convert_lit_checkpoint`` runs) as F(sd)."""
    from litgpt.scripts.convert_lit_checkpoint import copy_weights_llama

    def lit_to_hf(sd: dict) -> dict:
        out: dict = {}
        copy_weights_llama(config, out, dict(sd))
        return out

    return lit_to_hf


def litgpt_cases(root: Path) -> tuple[LibCase, LibCase]:
    """litgpt's ``convert_hf_checkpoint`` (HF -> one fused ``attn.qkv``) and back.

    Case 1: the live transformers model against the ``lit_model.pth`` litgpt wrote from its
    ``save_pretrained`` files. Case 2: litgpt's own GPT, loaded from that file, against the
    ``model.pth`` ``convert_lit_checkpoint`` wrote (q, k, v split again).
    """
    from litgpt import GPT
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint
    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint
    from litgpt.utils import save_config

    hf = hf_llama()
    folder = root / "lit"
    hf.save_pretrained(folder)
    convert_hf_checkpoint(folder, model_name="Llama-2-7b-hf")
    config = litgpt_config()
    save_config(config, folder)  # the small model's own config, for the way back
    convert_lit_checkpoint(folder, root / "lit_hf")
    to_lit = litgpt_hf_to_lit(config)
    first = LibCase("litgpt-hf-to-lit", hf, to_lit, folder / "lit_model.pth")
    qkv = "transformer.h.1.attn.qkv.weight"
    # Row 40 of the fused qkv is row 8 of k (q takes 32 rows): a k element.
    plant_one(first, qkv, (40, 3), root)
    first.source = source_of(to_lit, dict(hf.state_dict()), qkv, (40, 3))
    rows = H * HD

    def kv_swapped(sd: dict) -> list[str]:
        # q, v, k fused instead of q, k, v (the order of a split that went wrong)
        w = sd[qkv]
        q, k, v = w.split([rows, KV * HD, KV * HD])
        sd[qkv] = torch.cat([q, v, k])
        return [qkv]

    faulty(first, "qkv_order", kv_swapped, root)
    swapped(first, "gate_up_swapped", [(f"transformer.h.{i}.mlp.fc_1.weight",
                                        f"transformer.h.{i}.mlp.fc_2.weight")
                                       for i in range(LAYERS)], root)  # fmt: skip
    zeros(first, "transformer.h.0.attn.proj.weight", root)

    gpt = GPT(config)
    gpt.load_state_dict(torch.load(folder / "lit_model.pth", weights_only=True))
    to_hf = litgpt_lit_to_hf(config)
    second = LibCase("litgpt-lit-to-hf", gpt.eval(), to_hf, root / "lit_hf" / "model.pth")
    v = "model.layers.0.self_attn.v_proj.weight"
    plant_one(second, v, (9, 30), root)
    second.source = source_of(to_hf, dict(gpt.state_dict()), v, (9, 30))
    zeros(second, "model.layers.1.self_attn.k_proj.weight", root)
    return first, second


# -------------------------------------------------------------------------------------------
#: GPT-2's Conv1D stores [in, out], the transpose of the nn.Linear layout: the four per block.
GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

#: The conversion from transformers' GPT-2 to the nn.Linear layout, as a spec.
GPT2_SPEC: dict[str, Any] = {
    "description": "GPT-2 Conv1D -> nn.Linear",
    "rules": [
        {"from": f"transformer.h.{{i}}.{m}.weight", "to": f"transformer.h.{{i}}.{m}.weight",
         "ops": [{"op": "t"}]}
        for m in GPT2_CONV1D
    ],
}  # fmt: skip


def gpt2_linear(root: Path) -> LibCase:
    """transformers' GPT-2 (Conv1D weights) against an nn.Linear export of it.

    The export holds each Conv1D as the nn.Linear that computes the same thing (checked on a
    batch with the library's own Conv1D forward), as code that loads GPT-2 into a Linear
    model does. ``attn.c_proj`` is square ([32, 32]): a forgotten transpose keeps its shape.
    """
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=DIM, n_layer=LAYERS, n_head=H, n_positions=32)
    model = GPT2LMHeadModel(cfg).eval()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Conv1D":  # the Linear computes what the Conv1D does
                x = torch.randn(3, module.weight.shape[0])
                w = module.weight.t()
                assert torch.allclose(F.linear(x, w, module.bias), module(x), atol=1e-6)
    for k, v in model.state_dict().items():
        conv = any(f".{m}.weight" in k for m in GPT2_CONV1D)
        out[k] = v.t().contiguous() if conv else v.clone()
    out.pop("lm_head.weight", None)  # tied to the embedding: saved once, as save_pretrained does
    path = root / "gpt2_linear.safetensors"
    from safetensors.torch import save_file

    save_file(out, str(path))
    case = LibCase("gpt2-linear", model, GPT2_SPEC, path)
    key = "transformer.h.0.attn.c_attn.weight"
    plant_one(case, key, (70, 4), root)
    case.source = ("transformer.h.0.attn.c_attn.weight", (4, 70))
    forgot = [f"transformer.h.{i}.attn.c_proj.weight" for i in range(LAYERS)]

    def forgotten(sd: dict) -> list[str]:
        for k in forgot:  # square: the shape does not tell
            sd[k] = model.state_dict()[k].clone()
        return forgot

    faulty(case, "no_transpose", forgotten, root)
    zeros(case, "transformer.h.1.mlp.c_fc.weight", root)
    return case


# -------------------------------------------------------------------------------------------
EXPERTS = 3


def mixtral(seed: int = 0, tied: bool = False) -> Any:
    """A small transformers Mixtral (stacked experts live: ``mlp.experts.gate_up_proj``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FF, num_hidden_layers=LAYERS,
        num_attention_heads=H, num_key_value_heads=KV, num_local_experts=EXPERTS,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return MixtralForCausalLM(cfg).eval()


def mixtral_case(root: Path) -> LibCase:
    """Mixtral against its own ``save_pretrained`` (one key per expert), nothing stated."""
    model = mixtral()
    model.save_pretrained(root / "mixtral")
    case = LibCase("mixtral", model, None, root / "mixtral")
    e = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    plant_one(case, e.format(0, 1, "w3"), (5, 9), root)
    # w3 (up) is the second half of gate_up_proj's rows for its expert.
    case.source = ("model.layers.0.mlp.experts.gate_up_proj", (1, FF + 5, 9))
    swapped(case, "experts_swapped", [(e.format(1, 0, w), e.format(1, 2, w)) for w in
                                      ("w1", "w2", "w3")], root)  # fmt: skip
    swapped(case, "gate_up_swapped", [(e.format(0, 2, "w1"), e.format(0, 2, "w3"))], root)
    zeros(case, e.format(1, 1, "w2"), root)
    return case


# -------------------------------------------------------------------------------------------
# What the tests assert on, computed where the library lives (in the test process, or in the
# child process that runs torchtune: tests/corpus/convert_tune.py).
def _source(f: Any) -> list[Any] | None:
    return [f.abs_source[0], list(f.abs_source[1])] if f.abs_source else None


def report_of(r: Any) -> dict[str, Any]:
    """A report as JSON-able facts."""
    return {
        "ok": r.ok,
        "findings": [
            [f.key, f.kind, list(f.max_abs_index) if f.max_abs_index else None, f.mismatched]
            for f in r.findings
        ],
        "sources": [_source(f) for f in r.findings],
        "keys": [r.keys_a, r.keys_b, r.keys_checked],
        "elements": r.elements_checked,
        "notes": list(r.notes),
        "mapping": [[m.a, m.b, m.status, m.reason] for m in r.mapping],
        "text": str(r),
    }


def checks(case: LibCase) -> dict[str, Any]:
    """Every check of a case, run: the clean file, each fault, the one element, fingerprints."""
    import fsdpcheck
    from fsdpcheck.testing import unchanged

    out: dict[str, Any] = {"plant": [case.plant[0], list(case.plant[1])],
                           "source": [case.source[0], list(case.source[1])]}  # fmt: skip
    with unchanged(case.live):
        out["clean"] = report_of(fsdpcheck.verify(case.live, case.clean, convert=case.convert))
        out["faults"] = {
            fault: {"report": report_of(fsdpcheck.verify(case.live, path, convert=case.convert)),
                    "expected": keys}
            for fault, (path, keys) in case.faults.items()
        }  # fmt: skip
        convert = case.convert
        if convert is None:  # Mixtral: the library's own function save_pretrained runs
            from transformers.core_model_loading import revert_weight_conversion

            convert = functools.partial(revert_weight_conversion, case.live)
        live = fsdpcheck.fingerprint(case.live, convert=convert)
    file = fsdpcheck.fingerprint_checkpoint(case.clean)
    planted = fsdpcheck.fingerprint_checkpoint(case.faults["one_element"][0])
    out["file_entries"] = len(file)
    out["file_elements"] = sum(v.numel() for v in read_file(weights_file(case.clean)).values())
    out["fingerprints_equal"] = live == file
    out["planted_differs"] = sorted(k for k in file if planted[k] != live.get(k))
    return out
