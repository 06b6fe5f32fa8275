"""What a checkpoint path is, recognised from its own structure: the one dispatcher.

``describe_path`` is what ``open_source``, ``load``, ``audit`` and ``inspect`` all ask. It looks
at file names and small marker files only (never unpickles anything): fsdpcheck.save (a DCP
directory with a manifest), torchtitan step folders, accelerate ``save_state`` directories,
Lightning checkpoints, Hugging Face folders (single file or sharded with an index), DeepSpeed
ZeRO checkpoints, megatron-core ``dist_checkpointing`` directories, plain DCP and torch.save /
safetensors files.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fsdpcheck.manifest import MANIFEST_NAME

LAYOUTS = (
    "fsdpcheck",
    "torchtitan",
    "accelerate",
    "lightning",
    "transformers",
    "deepspeed",
    "megatron",
    "dcp",
    "torch.save",
    "safetensors",
)
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# Top-level entries torchtitan's CheckpointManager writes besides the model and optimizer.
_TORCHTITAN_STATE = ("train_state", "lr_scheduler", "dataloader")


@dataclass
class CheckpointInfo:
    """A recognised checkpoint.

    Attributes:
        path: The path given.
        layout: One of LAYOUTS.
        kind: "sharded" (DCP chunks) or "full" (whole tensors).
        description: One line for humans.
        parts: The files or DCP directories that hold its tensors (model first).
        notes: What is not read (e.g. DeepSpeed's flattened optimizer partitions).
    """

    path: Path
    layout: str
    kind: str
    description: str
    parts: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def is_dcp_dir(path: Path) -> bool:
    """Whether `path` is a DCP checkpoint directory (it holds a ``.metadata`` of any type).

    A ``.metadata`` that is not a regular file (or a dangling link) still marks the directory,
    so that opening it refuses the file with a clear line instead of treating the directory as
    something else.
    """
    try:
        return path.is_dir() and os.path.lexists(path / ".metadata")
    except OSError:
        return False


def describe_path(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Recognises a checkpoint's layout from its structure.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: It is not a checkpoint fsdpcheck recognises (the message says what it holds).
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {p} does not exist") from None
    except PermissionError:
        raise PermissionError(
            f"checkpoint {p}: permission denied (a folder on its path may not be searched)"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        return _directory(p)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"checkpoint {p} is not a regular file or a directory; refusing it")
    return _file(p)


def _file(p: Path) -> CheckpointInfo:
    if p.name.endswith(".safetensors.index.json"):
        hf = (p.parent / "config.json").is_file()
        layout = "transformers" if hf else "safetensors"
        return CheckpointInfo(p, layout, "full", f"a sharded safetensors index ({p.name})", [p])
    if p.suffix == ".safetensors":
        return CheckpointInfo(p, "safetensors", "full", f"a safetensors file ({p.name})", [p])
    if _is_deepspeed_states(p.name):
        return _deepspeed(p.parent, p.parent)
    if p.suffix == ".ckpt":
        return CheckpointInfo(
            p, "lightning", "full", f"a Lightning checkpoint file ({p.name})", [p]
        )
    if p.suffix in TORCH_SAVE_SUFFIXES:
        return CheckpointInfo(p, "torch.save", "full", f"a torch.save file ({p.name})", [p])
    raise ValueError(
        f"{p} is not a checkpoint fsdpcheck recognises (expected a DCP directory, a torch.save "
        f"file {'/'.join(TORCH_SAVE_SUFFIXES)}, .safetensors or *.safetensors.index.json)"
    )


def _directory(p: Path) -> CheckpointInfo:
    if is_dcp_dir(p):
        return _dcp(p)
    names = {q.name for q in _listdir(p)}
    if "latest" in names or any(_is_deepspeed_states(n) for n in names):
        return _deepspeed(p, _deepspeed_tag(p) if "latest" in names else p)
    fsdp = sorted(n for n in names if re.fullmatch(r"pytorch_model_fsdp_\d+", n))
    accelerate_markers = any(
        re.fullmatch(
            r"(random_states_\d+\.pkl|optimizer(_\d+)?(\.bin)?|scheduler(_\d+)?\.bin|"
            r"pytorch_model_fsdp(_\d+)?(\.bin)?)",
            n,
        )
        for n in names
    )
    if fsdp or accelerate_markers:
        return _accelerate(p)
    index = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    tensors = sorted(n for n in names if n.endswith(".safetensors"))
    if index or tensors:
        hf = "config.json" in names
        layout = "transformers" if hf else "safetensors"
        what = "Hugging Face folder" if hf else "folder of safetensors"
        if index:
            if len(index) > 1:
                raise ValueError(
                    f"{p} holds {len(index)} safetensors indexes ({', '.join(index)})"
                    "; pass the one to use"
                )
            return CheckpointInfo(
                p, layout, "full", f"a {what}, sharded ({index[0]})", [p / index[0]]
            )
        return CheckpointInfo(
            p, layout, "full", f"a {what} ({', '.join(tensors[:3])})", [p / t for t in tensors]
        )
    steps = sorted(
        (q for q in _listdir(p) if re.fullmatch(r"step-\d+", q.name) and is_dcp_dir(q)),
        key=lambda q: int(q.name.split("-")[1]),
    )
    if steps:
        raise ValueError(
            f"{p} is a torchtitan checkpoint folder with {len(steps)} step(s); pass one of them, "
            f"e.g. {steps[-1]}"
        )
    saved = sorted(q for q in _listdir(p) if q.suffix in TORCH_SAVE_SUFFIXES and q.is_file())
    if len(saved) == 1:
        info = _file(saved[0])
        info.path = p
        return info
    if not names:
        raise ValueError(f"{p} is an empty directory, not a checkpoint")
    raise ValueError(
        f"{p} holds no checkpoint fsdpcheck recognises: no DCP .metadata, no safetensors, and "
        f"{len(saved)} torch.save files (pass one file, or a DCP directory)"
    )


def _listdir(p: Path) -> list[Path]:
    try:
        return sorted(p.iterdir())
    except OSError as exc:
        raise ValueError(f"cannot list {p}: {exc.strerror or exc}") from None


def _dcp(p: Path) -> CheckpointInfo:
    if (p / MANIFEST_NAME).exists():
        return CheckpointInfo(
            p, "fsdpcheck", "sharded", f"a DCP checkpoint written by fsdpcheck.save ({p})", [p]
        )
    meta = p / "metadata.json"
    if meta.is_file() and meta.stat().st_size < 1 << 20:
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except (ValueError, AttributeError, UnicodeDecodeError):
            backend = None
        if backend:
            return CheckpointInfo(
                p,
                "megatron",
                "sharded",
                f"a megatron-core dist_checkpointing directory ({backend}, {p})",
                [p],
                _side_files(p, "common.pt", "megatron's non-tensor state (iteration, args, ...)"),
            )
    if (p / "meta.pt").is_file():
        return CheckpointInfo(
            p,
            "lightning",
            "sharded",
            f"a Lightning distributed checkpoint ({p})",
            [p],
            _side_files(p, "meta.pt", "Lightning's non-tensor state (epoch, loops, ...)"),
        )
    if re.fullmatch(r"step-\d+", p.name):
        return CheckpointInfo(p, "torchtitan", "sharded", f"a torchtitan step folder ({p})", [p])
    return CheckpointInfo(p, "dcp", "sharded", f"a DCP checkpoint directory ({p})", [p])


def _side_files(p: Path, name: str, what: str) -> list[str]:
    """A note naming a file of non-tensor state beside the tensors (read by nothing here)."""
    if (p / name).exists():
        return [f"{name} holds {what}: not read (fsdpcheck reads tensors, and runs no pickle)"]
    return []


def accelerate_parts(path: Path, index: int = 0) -> tuple[Path | None, Path | None]:
    """(model, optimizer) checkpoint of model/optimizer `index` in a save_state directory."""
    s = "" if index == 0 else f"_{index}"
    models = (
        f"pytorch_model_fsdp_{index}",
        f"pytorch_model_fsdp{s}.bin",
        f"model{s}.safetensors",
        f"pytorch_model{s}.bin",
    )
    optims = (f"optimizer_{index}", f"optimizer_{index}.bin", f"optimizer{s}.bin")

    def first(names: tuple[str, ...]) -> Path | None:
        for n in names:
            q = path / n
            if is_dcp_dir(q) or q.is_file():
                return q
        return None

    return first(models), first(optims)


def _accelerate(p: Path) -> CheckpointInfo:
    model, optim = accelerate_parts(p)
    if model is None:
        raise ValueError(
            f"{p} looks like an accelerate save_state directory but holds no model "
            "checkpoint (pytorch_model_fsdp_0/, model.safetensors, ...)"
        )
    kind = "sharded" if is_dcp_dir(model) else "full"
    parts = [q for q in (model, optim) if q is not None]
    what = ", ".join(q.name + ("/" if q.is_dir() else "") for q in parts)
    return CheckpointInfo(
        p, "accelerate", kind, f"an accelerate save_state directory ({kind}: {what})", parts
    )


def _deepspeed_tag(p: Path) -> Path:
    tag = (p / "latest").read_text().strip() if (p / "latest").is_file() else ""
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise ValueError(f"{p / 'latest'} does not name a checkpoint folder inside {p}")
    return p / tag


def _is_deepspeed_states(name: str) -> bool:
    """DeepSpeed model states (ZeRO-1/2: ``mp_rank_XX_...``; ZeRO-3: ``zero_pp_rank_R_...``)."""
    return name.endswith("_model_states.pt") and "mp_rank_" in name


def _deepspeed(p: Path, folder: Path) -> CheckpointInfo:
    # The plain name first: ZeRO-1/2's single file holds the full module weights.
    states = sorted(
        (q for q in folder.iterdir() if _is_deepspeed_states(q.name)),
        key=lambda q: (not q.name.startswith("mp_rank_"), q.name),
    )
    if not states:
        raise ValueError(f"{folder} holds no DeepSpeed *mp_rank_*_model_states.pt")
    zero = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))
    notes = []
    if zero:
        notes.append(
            f"{len(zero)} ZeRO optimizer partition file(s) hold flattened state that "
            "cannot be mapped to parameters; not read"
        )
    if len(states) > 1:
        notes.append(f"{len(states)} model-parallel ranks: only {states[0].name} is read")
    return CheckpointInfo(
        p,
        "deepspeed",
        "full",
        f"a DeepSpeed checkpoint ({folder.name}/{states[0].name})",
        [states[0]],
        notes,
    )
