"""Plain torch.distributed.checkpoint: an FSDP2 model and AdamW, saved four ways.

FQN-keyed optimizer state (``get_state_dict``) and integer ids (a raw
``optimizer.state_dict()``), each under ``{"model": ..., "optim": ...}`` and flat.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.corpus import (
    TOY_FQNS,
    Case,
    Cases,
    Planted,
    optim_keys,
    plant,
    shard_toy,
    toy_case,
    toy_model,
)
from tests.corpus.live import Live, adamw, train_steps

VARIANTS = ("fqn_nested", "fqn_flat", "ids_nested", "ids_flat")
PLANT_WEIGHT = ("layers.1.proj.weight", (6, 3))
PLANT_MOMENT = ("layers.0.proj.weight", "exp_avg", (2, 5))
LIBRARY = f"torch {torch.__version__} distributed.checkpoint"


CASES = Cases(
    library="dcp",
    requires="torch",
    layout="dcp",
    names=(*(f"dcp_{v}" for v in VARIANTS), "dcp_chunk_flipped"),
    live=tuple(f"dcp_{v}" for v in VARIANTS),
    order=0,
)


def train(rank: int, world: int) -> Live:
    """FSDP2 toy model after two AdamW steps."""
    model = shard_toy(toy_model())
    opt = adamw(model.parameters())
    train_steps(model, opt, rank)
    return Live(model=model, optimizer=opt, inner=model)


def state(live: Live, variant: str) -> dict[str, Any]:
    """The state dict a user of plain DCP would hand to ``dcp.save`` for `variant`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if variant.startswith("fqn"):
        msd, osd = get_state_dict(live.model, live.optimizer)
    else:
        msd, osd = live.model.state_dict(), live.optimizer.state_dict()
    return {"model": msd, "optim": osd} if variant.endswith("nested") else {**msd, **osd}


def save(live: Live, path: Path, variant: str) -> None:
    """``dcp.save`` of the `variant` state dict."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state(live, variant), checkpoint_id=str(path))


def build(rank: int, world: int, root: Path) -> list[Case]:
    """Saves the four variants, their planted twins, and a copy with one chunk's bytes flipped."""
    live = train(rank, world)
    cases = []
    for variant in VARIANTS:
        clean, planted = root / f"dcp_{variant}", root / f"dcp_{variant}_planted"
        save(live, clean, variant)
        with plant(live.inner, PLANT_WEIGHT, live.optimizer, PLANT_MOMENT):
            save(live, planted, variant)
        cases.append(
            toy_case(
                f"dcp_{variant}",
                LIBRARY,
                "dcp",
                clean,
                planted,
                PLANT_WEIGHT,
                PLANT_MOMENT,
                make_live="tests.corpus.dcp_plain:train",
                extra={"variant": variant},
            )
        )
    dist.barrier()
    if rank == 0:
        cases.append(flip_chunk(root / "dcp_fqn_nested", root / "dcp_chunk_flipped"))
    return cases


def flip_chunk(src: Path, dst: Path) -> Case:
    """A copy of `src` with one element's bytes changed inside its .distcp file.

    The element is found from DCP's own metadata: ``storage_data`` names the file, offset and
    length of the chunk that holds ``model.embed.weight`` rows 5.. (rank 1's shard), and the
    chunk's raw bytes are located inside that blob by their value, so nothing about torch's
    serialisation is assumed.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    shutil.copytree(src, dst)
    key, index = "model.embed.weight", (7, 4)
    md = FileSystemReader(str(dst)).read_metadata()
    chunk = next(
        c
        for c in md.state_dict_metadata[key].chunks
        if c.offsets[0] <= index[0] < c.offsets[0] + c.sizes[0]
    )
    info = md.storage_data[MetadataIndex(key, chunk.offsets)]
    import torch.distributed.checkpoint as dcp

    whole = {"model": {"embed.weight": torch.empty(md.state_dict_metadata[key].size)}}
    dcp.load(whole, checkpoint_id=str(src), no_dist=True)
    rows = whole["model"]["embed.weight"][chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]]
    raw = rows.contiguous().numpy().tobytes()
    f = dst / info.relative_path
    data = bytearray(f.read_bytes())
    blob = bytes(data[info.offset : info.offset + info.length])
    at = blob.find(raw)
    if at < 0 or blob.find(raw, at + 1) >= 0:
        raise RuntimeError(f"{key}: the chunk's bytes are not found exactly once in {f}")
    elem = (index[0] - chunk.offsets[0]) * rows.shape[1] + index[1]
    pos = info.offset + at + elem * rows.element_size()
    data[pos + 2] ^= 0x01  # a mantissa bit: finite, and a change no exact comparison misses
    f.write_bytes(bytes(data))
    return Case(
        name="dcp_chunk_flipped",
        library=LIBRARY,
        path=str(src),
        expected_layout="dcp",
        model_keys=sorted(TOY_FQNS),
        optim_tensor_keys=sorted(optim_keys(TOY_FQNS)),
        planted_path=str(dst),
        planted=[Planted("embed.weight", index, "chunk")],
        extra={"file": info.relative_path},
    )
