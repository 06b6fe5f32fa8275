"""What every checkpoint layout module provides: recognition, a key grammar, its quirks.

A layout is one writer's way of putting a checkpoint on disk (fsdpcheck.save, torchtitan,
accelerate, a Hugging Face Trainer folder, ...). Everything fsdpcheck knows about one writer
lives in its module under ``fsdpcheck/formats/``:

- ``recognize(probe)``: whether a path is this layout's, from file names and small marker files
  only (never unpickling anything), and what it holds (``CheckpointInfo``: the parts that hold
  tensors, each a ``Part`` with its role and the reader that opens it, and the side files a
  resume reads);
- ``grammar``: how its keys name model tensors, optimizer state and hyperparameters
  (``KeyGrammar``);
- ``placeholder(entry)``: entries that stand for values stored elsewhere (DeepSpeed ZeRO-3),
  which are named as skipped, never compared.

``fsdpcheck.formats.LAYOUTS`` holds every layout defined in the package, in the order of their
``rank`` (NOTE: [layout ranks]); ``describe_path`` asks each in turn, the way DCP's
``_storage_setup`` asks each reader class.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from fsdpcheck.names import WRAPPER_PREFIXES

if TYPE_CHECKING:
    from fsdpcheck.sources.base import Source
    from fsdpcheck.sources.dcp.source import Verdicts
    from fsdpcheck.sources.remote import RemotePath

# Part roles: what a part of a checkpoint holds. "any" parts are read by their own structure.
ROLES = ("any", "model", "optimizer", "adapter")

# Top-level containers of a nested checkpoint: where writers put the model and the optimizer.
MODEL_CONTAINERS = frozenset(
    {"model", "module", "state_dict", "model_state_dict", "model_state", "models"}
)
OPTIM_CONTAINERS = frozenset(
    {"optim", "optimizer", "optimizers", "optimizer_state_dict", "optim_state", "optimizer_states"}
)
_NUMBERED_OPTIM = re.compile(r"^(?:optimizer|optim)_(\d+)$")
_FLAT_STATE = re.compile(r"^state\.(.+)\.([^.]+)$")
_FLAT_GROUP = re.compile(r"^param_groups\.(.+)\.([^.]+)$")


@dataclass(frozen=True)
class OptimPath:
    """Where an optimizer entry belongs: ("state" | "group", parameter or group, name, index)."""

    kind: str
    who: str
    item: str
    optimizer: int = 0


@dataclass(frozen=True)
class KeyGrammar:
    """How a layout's keys name model tensors, optimizer state and hyperparameters.

    Attributes:
        model_containers: Top-level names under which the model's tensors sit.
        optim_containers: Top-level names under which optimizer state sits.
        wrapper_prefixes: Leading components this writer's wrappers put before every model name.
        state_name_first: Optimizer state is keyed ``state.<name>.<fqn>`` (megatron-core's
            ``optimizer.state.<state>.<param key>``) instead of ``state.<fqn>.<name>``.
        step_per_parameter: Adam's ``step`` is saved with each parameter's moments (torch's
            layout); megatron-core keeps it in the param groups instead.
    """

    model_containers: frozenset[str] = MODEL_CONTAINERS
    optim_containers: frozenset[str] = OPTIM_CONTAINERS
    wrapper_prefixes: tuple[str, ...] = WRAPPER_PREFIXES
    state_name_first: bool = False
    step_per_parameter: bool = True

    def optim_path(self, p: tuple[str, ...]) -> OptimPath | None:
        """The optimizer role of an entry's structural path, or None for anything else."""
        rest, index = p, 0
        numbered = _NUMBERED_OPTIM.match(rest[0]) if len(rest) > 1 else None
        if numbered:  # optimizer_<i>: Lightning's ModelParallelStrategy saves optimizer i there
            index, rest = int(numbered.group(1)), rest[1:]
        elif len(rest) > 1 and rest[0] in self.optim_containers:
            rest = rest[1:]
            if len(rest) > 1 and rest[0].isdigit():  # a list of optimizers (Lightning .ckpt)
                index, rest = int(rest[0]), rest[1:]
        elif len(rest) == 1 and "." in rest[0]:
            head, _, tail = rest[0].partition(".")
            if head in self.optim_containers:
                rest = (tail,)
        if len(rest) == 3 and rest[0] in ("state", "param_groups"):
            kind = "state" if rest[0] == "state" else "group"
            who, item = rest[1], rest[2]
            if kind == "state" and self.state_name_first:
                who, item = item, who
            return OptimPath(kind, who, item, index)
        if len(rest) == 1:
            if self.state_name_first and rest[0].startswith("state."):
                item, _, who = rest[0][len("state.") :].partition(".")
                if item and who:
                    return OptimPath("state", who, item, index)
                return None
            m = _FLAT_STATE.match(rest[0])
            if m:
                return OptimPath("state", m.group(1), m.group(2), index)
            m = _FLAT_GROUP.match(rest[0])
            if m:
                return OptimPath("group", m.group(1), m.group(2), index)
        return None

    def top(self, p: tuple[str, ...]) -> str:
        """The top-level container an entry sits in ("" when flat or in none)."""
        if len(p) > 1 and (
            p[0] in self.model_containers
            or p[0] in self.optim_containers
            or _NUMBERED_OPTIM.match(p[0])
        ):
            return p[0]
        return ""


DEFAULT_GRAMMAR = KeyGrammar()


class Reader(Protocol):
    """Opens one part of a checkpoint: a ``Source`` over `path`.

    `trust`: the verdicts of another process's check of a DCP ``.metadata``
    (``fsdpcheck.opening``); readers of other storage take it and ignore it.
    """

    def __call__(self, path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
        """The part at `path`, opened."""
        ...


@dataclass(frozen=True)
class Part:
    """One file or DCP directory of a checkpoint, as its layout found it.

    Attributes:
        path: The file or directory (an object or prefix, ``sources.remote.RemotePath``, in an
            object store).
        role: What it holds: "model", "optimizer", "adapter" or "any" (read by its own
            structure).
        reader: What opens it (``fsdpcheck.formats.readers``, or the layout's own for a storage
            kind of its own): the layout names it, so opening never guesses from the path.
    """

    path: Path | RemotePath
    role: str
    reader: Reader

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"part {self.path}: role {self.role!r} is not one of {ROLES}")


@dataclass
class CheckpointInfo:
    """A recognised checkpoint.

    Attributes:
        path: The path given.
        layout: The name of one of ``fsdpcheck.formats.LAYOUTS``.
        kind: "sharded" (DCP chunks) or "full" (whole tensors).
        description: One line for humans.
        parts: The files or DCP directories that hold its tensors (model first), each with its
            role and its reader.
        notes: What is not read (e.g. DeepSpeed's flattened optimizer partitions).
        training: Files of training state beside the tensors (scheduler, RNG, trainer state):
            named in notes, never read.
    """

    path: Path | RemotePath
    layout: str
    kind: str
    description: str
    parts: Sequence[Part] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    training: list[Path] = field(default_factory=list)

    @property
    def paths(self) -> list[Path | RemotePath]:
        """Each part's path, in order."""
        return [p.path for p in self.parts]

    @property
    def roles(self) -> list[str]:
        """Each part's role, in order."""
        return [p.role for p in self.parts]


class Probe:
    """A path under recognition: its type and (for a directory) its names, read once.

    Attributes:
        path: The path.
        is_dir: Whether it is a directory.
        describe: Recognises another path as ``fsdpcheck.formats.describe_path`` does, for a
            layout whose checkpoint is read through a file inside it (``formats.hf_storage``:
            a consolidated folder is its index); handed in by ``describe_path``, so that a
            layout module never imports the registry that imports it.
    """

    def __init__(
        self, path: Path, st: os.stat_result, describe: Callable[[Path], CheckpointInfo]
    ) -> None:
        self.path = path
        self.is_dir = stat.S_ISDIR(st.st_mode)
        self.describe = describe

    @cached_property
    def names(self) -> set[str]:
        """Names in the directory (empty for a file)."""
        return {q.name for q in listdir(self.path)} if self.is_dir else set()

    @cached_property
    def is_dcp(self) -> bool:
        """Whether the path is a DCP checkpoint directory."""
        return self.is_dir and is_dcp_dir(self.path)

    def has_file(self, name: str) -> bool:
        """Whether the directory holds a regular file (or a link to one) of that name."""
        return name in self.names and (self.path / name).is_file()


# NOTE: [layout ranks] ``describe_path`` asks the layouts in the order of their ``rank``,
# smallest first, and the first that recognises a path describes it. A rank says how much a
# layout's recognition requires: its band (the hundreds, ``RANK_BANDS``) runs from the most
# specific to the least, so a layout never has to look at the layouts of other bands:
#
#   100  a DCP directory its writer marks with a file beside .metadata or by the folder's
#        name (fsdpcheck.save's manifest, torchtitan's step-N)
#   200  any DCP directory (dcp alone; no layout of a later band takes a DCP directory)
#   300  a writer's own file names or marker files, not DCP (DeepSpeed's latest and
#        model-states files, the Trainer's trainer_state.json, PEFT's adapter_config.json)
#   400  standard weight files beside a library's config file (transformers' config.json)
#   500  a file by its suffix alone, or a folder by the files it holds (.safetensors, .pt)
#
# A new layout takes a free number in the band of its most specific rule (lightning's DCP
# directories with meta.pt put it in 100, and its .ckpt files come before torch.save's with
# it). Within the band it goes before each layout that could also claim one of its paths, and
# those are the only ones it needs to read: deepspeed_universal (310) before deepspeed (320), as
# a universal folder holds DeepSpeed's model-states files too. Its module says why, beside the
# number. ``fsdpcheck.formats.LAYOUTS`` lists every layout in order (``rank``, ``name``); two
# layouts of one rank, a rank outside the bands or a layout without one stop
# ``fsdpcheck.formats`` from importing, with the layouts named (``formats.discover``).
#: The bands of ``CheckpointLayout.rank``: (first rank of the band, what its layouts require).
RANK_BANDS: tuple[tuple[int, str], ...] = (
    (100, "a DCP directory its writer marks (a file beside .metadata, or the folder's name)"),
    (200, "any DCP directory"),
    (300, "a writer's own file names or marker files, not DCP"),
    (400, "standard weight files beside a library's config file"),
    (500, "a file by its suffix, or a folder by the files it holds"),
)
#: Ranks run from the first band's start to this (exclusive).
RANK_END = 600


class CheckpointLayout:
    """One writer's checkpoint layout (see the module docstring).

    A subclass with a ``name``, defined in a module of ``fsdpcheck.formats``, is a layout:
    ``fsdpcheck.formats.LAYOUTS`` finds it there (a class without a name is a shared base).
    """

    #: The layout's name (``CheckpointInfo.layout``).
    name: ClassVar[str] = ""
    #: Where ``describe_path`` asks it, smallest first: a number in its band of ``RANK_BANDS``
    #: (NOTE: [layout ranks]). Every layout declares its own.
    rank: ClassVar[int | None] = None
    #: How its keys name things.
    grammar: ClassVar[KeyGrammar] = DEFAULT_GRAMMAR

    def recognize(self, probe: Probe) -> CheckpointInfo | None:
        """The CheckpointInfo when `probe` is this layout's, else None.

        Raises:
            ValueError: It is this layout's but not usable as given (the message says what to
                pass instead, e.g. one step folder of a torchtitan run).
        """
        del probe
        return None

    def placeholder(self, info: CheckpointInfo, shape: tuple[int, ...]) -> str | None:
        """Why a model entry of this shape stands for values stored elsewhere, or None."""
        del info, shape
        return None


def is_dcp_dir(path: Path | RemotePath) -> bool:
    """Whether `path` is a DCP checkpoint directory (it holds a ``.metadata`` of any type).

    A ``.metadata`` that is not a regular file (or a dangling link) still marks the directory,
    so that opening it refuses the file with a clear line instead of treating the directory as
    something else.
    """
    if not isinstance(path, Path):  # a prefix in an object store (sources.remote.RemotePath)
        from fsdpcheck.sources.remote import RemotePath

        return isinstance(path, RemotePath) and ".metadata" in path.listing()
    try:
        return path.is_dir() and os.path.lexists(path / ".metadata")
    except OSError:
        return False


def listdir(p: Path) -> list[Path]:
    """The directory's entries, sorted; an unreadable directory is a ValueError (one line)."""
    try:
        return sorted(p.iterdir())
    except OSError as exc:
        raise ValueError(f"cannot list {p}: {exc.strerror or exc}") from None


def side_file_note(p: Path, name: str, what: str) -> list[str]:
    """A note naming a file of non-tensor state beside the tensors (read by nothing here)."""
    if (p / name).exists():
        return [f"{name} holds {what}: not read (fsdpcheck reads tensors, and runs no pickle)"]
    return []


def training_note(files: list[Path]) -> list[str]:
    """A note naming the training-state files beside a checkpoint's tensors."""
    if not files:
        return []
    names = ", ".join(f.name for f in files)
    return [f"training state not compared (no tensors fsdpcheck checks): {names}"]
