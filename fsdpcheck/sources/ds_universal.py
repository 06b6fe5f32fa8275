"""The ``zero/`` folder of a DeepSpeed universal checkpoint, read as optimizer state.

Each ``zero/<fqn>/<name>.pt`` is a torch.save file (read by ``TorchSaveSource``: restricted
unpickling, mapped, only the boxes compared leave the disk) holding the whole tensor, either
bare (``step.pt``) or as ``{"param": tensor, "cat_dim": int, ...}`` (NOTE in
``fsdpcheck.formats.ds_universal``). Its entries are ``optimizer.state.<fqn>.<name>``:
``fp32`` (the master weight), ``exp_avg``, ``exp_avg_sq``, ``step``, and any other state the
converter wrote.

Whatever the folder holds that is not read is a problem (a finding; the verdict is not OK):
files of another kind, files that do not load, a dict without its ``param`` tensor or with other
tensors beside it, a ``cat_dim`` that is not one of the tensor's dims, and the module weights of
tensor-parallel ranks past the first (slices along each parameter's ``cat_dim``, not read).
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Entry, Problem, Region, Source
from fsdpcheck.sources.text import one_line
from fsdpcheck.sources.torch_save import TorchSaveSource

#: DeepSpeed's optimizer settings (loss scaler, param groups) as DeepSpeed objects: not read.
OPTIMIZER_STATE = "optimizer_state.pt"
# Files kept open (mapped) at once; the others are opened again when read.
_OPEN_FILES = 64
# The non-tensor fields ds_to_universal writes beside "param" (constants.py: CAT_DIM,
# VOCAB_TENSOR, SUB_PARAM_SHAPE, PARAM_N_SUB_PARAMS).
_FIELDS = ("cat_dim", "vocab_tensor", "sub_param_shape", "param_n_sub_params")


def is_model_states(name: str) -> bool:
    """DeepSpeed model states (ZeRO-1/2: ``mp_rank_XX_...``; ZeRO-3: ``zero_pp_rank_R_...``).

    The files beside a universal checkpoint's ``zero/`` folder, and what ``formats/deepspeed.py``
    and ``formats/ds_universal.py`` recognise DeepSpeed's checkpoints by.
    """
    return name.endswith("_model_states.pt") and "mp_rank_" in name


def model_states(folder: Path) -> list[Path]:
    """The ``*mp_rank_*_model_states.pt`` files of a universal folder, in rank order."""
    return sorted(q for q in folder.iterdir() if is_model_states(q.name) and q.is_file())


@dataclass(frozen=True)
class _Stored:
    """Where an entry's tensor is: the file and its key there ("" for a bare tensor)."""

    file: Path
    inner: str


class UniversalZeroSource(Source):
    """``zero/<fqn>/<name>.pt`` files as the entries ``optimizer.state.<fqn>.<name>``.

    Entry keys (and the keys of problems) are paths inside the folder: ``<fqn>/<name>.pt``.
    """

    kind = "deepspeed-universal"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"DeepSpeed universal {self.path.name}/ folder {self.path}"
        self._entries: dict[str, Entry] = {}
        self._stored: dict[str, _Stored] = {}
        self._problems: list[Problem] = []
        self._refused: dict[str, str] = {}
        self._open: OrderedDict[Path, TorchSaveSource] = OrderedDict()
        self._cat_dims: dict[str, int] = {}
        for q in _listdir(self.path):
            rel = q.name
            if q.name == OPTIMIZER_STATE:
                continue  # named by the layout's notes: settings, no tensors
            if q.is_symlink() or not q.is_dir():
                self._problem(rel, "is not a parameter folder: not read")
                continue
            self._param(q.name, q)
        self._other_ranks()

    # ---------------------------------------------------------------- opening
    def _problem(self, key: str, what: str) -> None:
        self._problems.append((key, "error", f"{self.path.name}/{key} {what}"))

    def _param(self, fqn: str, folder: Path) -> None:
        for f in _listdir(folder):
            rel = f"{fqn}/{f.name}"
            if f.suffix != ".pt" or f.is_symlink() or not _regular(f):
                self._problem(rel, "is not a state file (<name>.pt) of the parameter: not read")
                continue
            try:
                src = self._source(f)
            except (CheckpointError, OSError) as exc:
                self._problem(rel, f"cannot be read: {one_line(exc)}")
                continue
            tensors = {k: e for k, e in src.entries().items() if e.is_tensor}
            inner = "" if "" in tensors else "param"
            entry = tensors.get(inner)
            others = sorted(k for k in tensors if k != inner)
            if entry is None:
                self._problem(rel, "holds no 'param' tensor: not read")
                continue
            if others:
                self._problem(rel, f"holds tensors besides 'param' ({', '.join(others[:4])}): "
                                   "they are not read")  # fmt: skip
            state = f.name[: -len(".pt")]
            path = ("optimizer", "state", fqn, state)
            self._entries[rel] = Entry(rel, path, entry.shape, entry.dtype)
            self._stored[rel] = _Stored(f, inner)
            for key, _, problem in src.problems():
                if key == inner:
                    self._refused[rel] = problem
                    self._problem(rel, f"cannot be read: {problem}")
            if inner == "param":
                self._check_fields(rel, src, entry.shape)

    def _check_fields(self, rel: str, src: TorchSaveSource, shape: tuple[int, ...]) -> None:
        """``cat_dim`` must be a dim of the tensor: it is where its slices were joined."""
        fields = {k: e for k, e in src.entries().items() if not e.is_tensor}
        unknown = sorted(set(fields) - {"", *_FIELDS})
        if unknown:
            self._problem(rel, f"holds fields fsdpcheck does not know ({', '.join(unknown[:4])})"
                               ": how to read its 'param' is unknown")  # fmt: skip
            self._refused[rel] = f"{self.path.name}/{rel} holds unknown fields"
        if "cat_dim" in fields:
            cat = src.read_object("cat_dim")
            if (
                isinstance(cat, bool)
                or not isinstance(cat, int)
                or not 0 <= cat < max(len(shape), 1)
            ):
                why = f"has cat_dim {cat!r}, not a dim of its {len(shape)}-d 'param' {shape}"
                self._problem(rel, why)
                self._refused[rel] = f"{self.path.name}/{rel} {why}"
            else:
                self._cat_dims[rel] = cat

    def _other_ranks(self) -> None:
        """Model states of tensor-parallel ranks past the first: slices, not read."""
        try:
            states = model_states(self.path.parent)
        except OSError:
            return
        for q in states[1:]:
            self._problems.append(
                (
                    f"../{q.name}",  # beside this folder
                    "error",
                    f"{q.parent.name}/{q.name} holds another tensor-parallel rank's module weights "
                    "(slices along each parameter's cat_dim): not read; the fp32 masters "
                    "(optim.state.<fqn>.fp32) hold the whole parameters",
                )
            )

    def _source(self, f: Path) -> TorchSaveSource:
        src = self._open.get(f)
        if src is not None:
            self._open.move_to_end(f)
            return src
        src = TorchSaveSource(f)
        self._open[f] = src
        if len(self._open) > _OPEN_FILES:
            self._open.popitem(last=False)  # its mapping goes with its last view
        return src

    # ---------------------------------------------------------------- the Source contract
    def entries(self) -> dict[str, Entry]:
        """Every state tensor of every parameter folder."""
        return self._entries

    def problems(self) -> list[Problem]:
        """What the folder holds that is not read (see the module docstring)."""
        return self._problems

    def cat_dim(self, key: str) -> int | None:
        """The dim along which the tensor-parallel slices of an entry were joined, if recorded."""
        return self._cat_dims.get(key)

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region from its file (views of the mapped file on the CPU, else copies).

        Raises:
            CheckpointError: A region of an entry a problem names.
        """
        result = []
        for i, r in enumerate(regions):
            if r.key in self._refused:
                raise CheckpointError(self._refused[r.key])
            where = self._stored[r.key]
            got = self._source(where.file).read(
                [Region(where.inner, r.offset, r.size)],
                device,
                [out[i]] if out is not None else None,
            )
            result.append(got[0])
        return result

    def read_object(self, key: str) -> Any:
        """There are no non-tensor entries."""
        raise KeyError(key)

    def close(self) -> None:
        """Drops the open files (their mappings go with the last view of them)."""
        self._open.clear()


def _listdir(p: Path) -> list[Path]:
    try:
        return sorted(p.iterdir())
    except OSError as exc:
        raise CheckpointError(f"cannot list {p}: {exc.strerror or exc}") from None


def _regular(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return False
