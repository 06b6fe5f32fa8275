"""Sharded torch.save Hugging Face weights: ``pytorch_model-0000x-of-0000y.bin`` + index.

transformers 5.24's ``save_pretrained`` ignores ``safe_serialization=False`` (it always writes
safetensors), so the folders are written by what still writes that format: accelerate's
``Accelerator.save_model(model, dir, max_shard_size=..., safe_serialization=False)`` (which
shards with huggingface_hub's ``split_torch_state_dict_into_shards`` and ``torch.save``s each
shard). Runs in one process, like tests/corpus/hf.py, on the same tiny untied Llama.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.corpus import Case, Cases, Planted, plant
from tests.corpus.hf import make_untied, model_keys

PLANTED = ("lm_head.weight", (5, 7))
# Small enough that the 0.1 MB of weights make several shards.
MAX_SHARD = "20KB"


CASES = Cases(
    library="hf_bin",
    requires="transformers",
    layout="torch.save",
    names=("hf_bin_bare", "hf_bin_config"),
    live=("hf_bin_bare", "hf_bin_config"),
    dist=False,
    order=1,
)


def save_model(model: torch.nn.Module, path: Path) -> None:
    """accelerate's ``save_model`` with ``safe_serialization=False`` (single process)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    try:
        Accelerator(cpu=True).save_model(
            model, path, max_shard_size=MAX_SHARD, safe_serialization=False
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # leave no process-wide state


def build(root: Path) -> list[Case]:
    """Two folders and their planted twins: as accelerate writes it, and with the config.json
    a hub folder has beside it (what makes it a Hugging Face folder)."""
    import accelerate

    lib = f"accelerate {accelerate.__version__} save_model(safe_serialization=False)"
    model = make_untied()
    cases = []
    for name, layout in (("hf_bin_bare", "torch.save"), ("hf_bin_config", "transformers")):
        clean, planted = root / name, root / f"{name}_planted"
        save_model(model, clean)
        with plant(model, PLANTED):
            save_model(model, planted)
        if layout == "transformers":
            for folder in (clean, planted):
                model.config.save_pretrained(folder)  # type: ignore[operator]
        cases.append(
            Case(
                name=name,
                library=lib,
                path=str(clean),
                expected_layout=layout,
                model_keys=model_keys(False),
                planted_path=str(planted),
                planted=[Planted(*PLANTED, "weight")],
                make_live="tests.corpus.hf:make_untied",
                extra={"sharded": True, "shards": len(list(clean.glob("*.bin")))},
            )
        )
    return cases
