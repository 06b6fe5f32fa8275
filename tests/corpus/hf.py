"""transformers: a tiny random Llama saved with ``save_pretrained`` (single file and sharded).

Runs in one process (no process group): ``save_pretrained`` is how HF checkpoints are made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.corpus import Case, Cases, Planted, plant

# 2 layers x 9 tensors + embed + final norm (+ lm_head when untied).
LAYER_TENSORS = (
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
)


CASES = Cases(
    library="transformers",
    requires="transformers",
    layout="transformers",
    names=("hf_tied_single", "hf_tied_sharded", "hf_untied_single", "hf_untied_sharded"),
    live=("hf_tied_single", "hf_tied_sharded", "hf_untied_single", "hf_untied_sharded"),
    dist=False,
    order=0,
)


def config(tied: bool) -> Any:
    """A Llama-style config small enough to build and save in well under a second."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def make_model(tied: bool) -> torch.nn.Module:
    """The live model: random weights that depend only on the seed (offline, no download)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config(tied)).eval()


def make_tied() -> torch.nn.Module:
    """The tied model (lm_head.weight is model.embed_tokens.weight)."""
    return make_model(True)


def make_untied() -> torch.nn.Module:
    """The untied model (lm_head.weight is its own tensor, outside ``model.``)."""
    return make_model(False)


def model_keys(tied: bool) -> list[str]:
    """The tensors save_pretrained writes, by their (canonical) FQNs."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    keys += [f"model.layers.{i}.{t}" for i in range(2) for t in LAYER_TENSORS]
    if not tied:
        keys.append("lm_head.weight")
    return sorted(keys)


def _save(model: torch.nn.Module, path: Path, sharded: bool) -> None:
    if sharded:
        model.save_pretrained(path, max_shard_size="20KB")  # type: ignore[operator]
    else:
        model.save_pretrained(path)  # type: ignore[operator]


def build(root: Path) -> list[Case]:
    """Builds the four folders (tied/untied x single/sharded) and their planted variants."""
    import transformers

    lib = f"transformers {transformers.__version__}"
    cases = []
    for tied in (True, False):
        model = make_model(tied)
        # The planted element: lm_head.weight (outside "model.") when untied; the shared
        # embedding when tied (the checkpoint holds it once, as model.embed_tokens.weight).
        key = "model.embed_tokens.weight" if tied else "lm_head.weight"
        index = (5, 7)
        for sharded in (False, True):
            name = f"hf_{'tied' if tied else 'untied'}_{'sharded' if sharded else 'single'}"
            clean, planted = root / name, root / f"{name}_planted"
            _save(model, clean, sharded)
            with plant(model, (key, index)):
                _save(model, planted, sharded)
            cases.append(
                Case(
                    name=name,
                    library=lib,
                    path=str(clean),
                    expected_layout="transformers",
                    model_keys=model_keys(tied),
                    planted_path=str(planted),
                    planted=[Planted(key, index, "tied" if tied else "weight")],
                    make_live=f"tests.corpus.hf:make_{'tied' if tied else 'untied'}",
                    tied={"lm_head.weight": "model.embed_tokens.weight"} if tied else {},
                    extra={"sharded": sharded},
                )
            )
    return cases
