"""A hand-made conversion between two layouts of one small model, stated the three ways.

The source layout is torchtitan's kind (fused ``wkv``, separate ``w1``/``w3``, one key per
expert, ``wo`` as saved), the target Hugging Face's kind (q/k rows permuted within each head,
``k``/``v`` split, ``gate_up`` concatenated, experts stacked, ``o_proj`` transposed as GPT-2's
``Conv1D`` stores it). The files a converter would write are made by running the conversion
on real data here; fsdpcheck only ever runs it on shape-only tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdpcheck.convert import permute_heads

H, KV, HD, DIM, FF, EXPERTS, LAYERS, VOCAB = 4, 2, 8, 32, 24, 3, 2, 16


def source_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model in the source layout (plain tensors)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"tok_embeddings.weight": r(VOCAB, DIM), "norm.weight": r(DIM)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd[p + "attention.wq.weight"] = r(H * HD, DIM)
        sd[p + "attention.wkv.weight"] = r(2 * KV * HD, DIM)
        sd[p + "attention.wo.weight"] = r(DIM, H * HD)  # square: a forgotten transpose fits
        sd[p + "feed_forward.w1.weight"] = r(FF, DIM)
        sd[p + "feed_forward.w3.weight"] = r(FF, DIM)
        sd[p + "feed_forward.w2.weight"] = r(DIM, FF)
        for e in range(EXPERTS):
            sd[p + f"moe.experts.{e}.w1"] = r(FF, DIM)
        sd[p + "moe.w2"] = r(EXPERTS, DIM, FF)  # stacked: one key per expert in the target
    return sd


def to_hf(sd: dict[str, Any], *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The conversion, as a converting library writes it: F(state_dict) -> state_dict."""
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    for i in range(LAYERS):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = permute_heads(sd[p + "attention.wq.weight"], H)
        k, v = sd[p + "attention.wkv.weight"].split([KV * HD, KV * HD])
        out[q + "self_attn.k_proj.weight"] = permute_heads(k, KV)
        out[q + "self_attn.v_proj.weight"] = v
        out[q + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"].t()
        out[q + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[p + "feed_forward.w1.weight"], sd[p + "feed_forward.w3.weight"]]
        )
        out[q + "mlp.down_proj.weight"] = sd[p + "feed_forward.w2.weight"]
        out[q + "mlp.experts.w1"] = torch.stack(
            [sd[p + f"moe.experts.{e}.w1"] for e in range(EXPERTS)]
        )
        for e, w in enumerate(sd[p + "moe.w2"].unbind(0)):
            out[q + f"mlp.experts.{e}.w2"] = w
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out


def to_hf_bf16(sd: dict[str, Any]) -> dict[str, Any]:
    """The conversion with an fp32 -> bf16 export."""
    return to_hf(sd, dtype=torch.bfloat16)


def _hf_to_source(sd: dict[str, Any]) -> dict[str, Any]:
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
    }
    for i in range(LAYERS):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[p + "attention.wq.weight"] = permute_heads(
            sd[q + "self_attn.q_proj.weight"], H, inverse=True
        )
        k = permute_heads(sd[q + "self_attn.k_proj.weight"], KV, inverse=True)
        out[p + "attention.wkv.weight"] = torch.cat([k, sd[q + "self_attn.v_proj.weight"]])
        out[p + "attention.wo.weight"] = sd[q + "self_attn.o_proj.weight"].t()
        w1, w3 = sd[q + "mlp.gate_up_proj.weight"].chunk(2)
        out[p + "feed_forward.w1.weight"], out[p + "feed_forward.w3.weight"] = w1, w3
        out[p + "feed_forward.w2.weight"] = sd[q + "mlp.down_proj.weight"]
        for e, w in enumerate(sd[q + "mlp.experts.w1"].unbind(0)):
            out[p + f"moe.experts.{e}.w1"] = w
        out[p + "moe.w2"] = torch.stack([sd[q + f"mlp.experts.{e}.w2"] for e in range(EXPERTS)])
    return out


class Adapter:
    """The same conversion as an adapter (torchtitan's StateDictAdapter shape)."""

    def to_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
        return to_hf(sd)

    def from_hf(self, sd: dict[str, Any]) -> dict[str, Any]:
        return _hf_to_source(sd)


SPEC: dict[str, Any] = {
    "description": "the hand-made spec",
    "rules": [
        {"from": "tok_embeddings.weight", "to": "model.embed_tokens.weight"},
        {"from": "norm.weight", "to": "model.norm.weight"},
        {"from": "layers.{i}.attention.wq.weight", "to": "model.layers.{i}.self_attn.q_proj.weight",
         "ops": [{"op": "permute_heads", "heads": H}]},
        {"from": "layers.{i}.attention.wkv.weight",
         "to": ["model.layers.{i}.self_attn.k_proj.weight",
                "model.layers.{i}.self_attn.v_proj.weight"],
         "ops": [{"op": "split", "dim": 0, "sizes": [KV * HD, KV * HD]},
                 {"op": "permute_heads", "heads": KV, "at": 0}]},
        {"from": "layers.{i}.attention.wo.weight", "to": "model.layers.{i}.self_attn.o_proj.weight",
         "ops": [{"op": "t"}]},
        {"from": ["layers.{i}.feed_forward.w1.weight", "layers.{i}.feed_forward.w3.weight"],
         "to": "model.layers.{i}.mlp.gate_up_proj.weight", "ops": [{"op": "cat", "dim": 0}]},
        {"from": "layers.{i}.feed_forward.w2.weight",
         "to": "model.layers.{i}.mlp.down_proj.weight"},
        {"from": "layers.{i}.moe.experts.{e*}.w1", "to": "model.layers.{i}.mlp.experts.w1",
         "ops": [{"op": "stack", "dim": 0}]},
        {"from": "layers.{i}.moe.w2", "to": "model.layers.{i}.mlp.experts.{e*}.w2",
         "ops": [{"op": "unbind", "dim": 0}]},
    ],
}  # fmt: skip


def converted(sd: dict[str, torch.Tensor], fn: Any = to_hf) -> dict[str, torch.Tensor]:
    """What a converter writes: F on the data, each tensor contiguous."""
    return {k: v.contiguous().clone() for k, v in fn(sd).items()}


#: An instance, for ``--convert tests.convert_cases:ADAPTER``.
ADAPTER = Adapter()

#: The conversion bugs a broken converter makes (``faulty``), each with the target keys it changes.
FAULTS: dict[str, list[str]] = {
    "no_permute": [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "kq"],
    "gate_up_swapped": [f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)],
    "zeros": ["model.layers.0.mlp.down_proj.weight"],
    "experts_swapped": ["model.layers.1.mlp.experts.w1"],
    "unstacked_swapped": ["model.layers.0.mlp.experts.0.w2", "model.layers.0.mlp.experts.2.w2"],
    "transpose_forgotten": ["model.layers.0.self_attn.o_proj.weight"],
}
#: ``faulty("one_element")``: one element changed after the conversion, at this target key and
#: index (row 21 of head 2 of q: source row 19 of ``layers.1.attention.wq.weight``).
PLANT = ("model.layers.1.self_attn.q_proj.weight", (21, 5))


def faulty(fault: str) -> dict[str, torch.Tensor]:
    """The converted file with one conversion bug of FAULTS, or "one_element" (PLANT)."""
    src = source_state()
    sd = converted(src)
    if fault == "no_permute":
        for i in range(LAYERS):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            sd[q + "self_attn.q_proj.weight"] = src[p + "attention.wq.weight"].clone()
            sd[q + "self_attn.k_proj.weight"] = src[p + "attention.wkv.weight"][: KV * HD].clone()
    elif fault == "gate_up_swapped":
        for i in range(LAYERS):
            p = f"layers.{i}.feed_forward."
            sd[f"model.layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [src[p + "w3.weight"], src[p + "w1.weight"]]
            )
    elif fault == "zeros":
        (key,) = FAULTS[fault]
        sd[key] = torch.zeros_like(sd[key])
    elif fault == "experts_swapped":
        (key,) = FAULTS[fault]
        sd[key] = sd[key][[0, 2, 1]].clone()
    elif fault == "unstacked_swapped":
        a, b = FAULTS[fault]
        sd[a], sd[b] = sd[b], sd[a]
    elif fault == "transpose_forgotten":  # wo is square: the untransposed tensor fits
        (key,) = FAULTS[fault]
        sd[key] = src["layers.0.attention.wo.weight"].clone()
    elif fault == "one_element":
        sd[PLANT[0]][PLANT[1]] += 1.0
    else:
        raise ValueError(f"no fault {fault!r}")
    return sd
