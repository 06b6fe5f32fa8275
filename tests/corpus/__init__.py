"""Checkpoints written by the trainer libraries' own save code, built at test time.

Each library module builds a tiny model, trains it a step or two, saves it with the library's
own checkpoint code, then changes one known element (a weight, an Adam moment) and saves again
with the same code. Each checkpoint is described by a ``Case``: where it is, the layout
fsdpcheck must recognise, the canonical key names it holds, and the planted changes (key and
global index) a comparison must name. Multi-rank cases are built by ``build_dist`` under
``torchrun`` (how users launch) and checked against live models by ``check_dist``.

Each builder module exports ``CASES`` (a ``Cases``: its library, the case names it writes and
how it is built); ``collect()`` finds them, for ``build_dist`` and ``tests/corpus/test_corpus.py``.
A new builder is one module here.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pkgutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

# Wrapper prefixes the contract strips from model AND optimizer keys.
WRAPPERS = (
    "module.",
    "_orig_mod.",
    "_forward_module.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)

# Where an element is planted: (model FQN, global index) for a weight, and
# (model FQN, optimizer state name, global index) for an optimizer moment.
WeightSpot = tuple[str, tuple[int, ...]]
MomentSpot = tuple[str, str, tuple[int, ...]]


@dataclass
class Planted:
    """One element changed on purpose before a second save with the library's own code.

    Attributes:
        key: Canonical name of the changed tensor (model FQN or ``optim.state.<fqn>.<name>``).
        index: Global index of the changed element.
        what: A word for the test id ("weight", "moment", "tied", "chunk").
    """

    key: str
    index: tuple[int, ...]
    what: str


@dataclass
class Case:
    """One checkpoint of the corpus and what fsdpcheck must say about it.

    Attributes:
        name: Unique id (also the folder name).
        library: The library whose save code wrote it (and version).
        path: What a user passes to fsdpcheck (step folder, save_state folder, file ...).
        expected_layout: What ``describe_path(path).layout`` must be.
        model_keys: Canonical names of the model tensors stored.
        optim_tensor_keys: Canonical names of the optimizer state tensors stored.
        non_tensor_keys: Top-level non-tensor entries a report must name in its notes.
        planted_path: The same state saved again with ``planted`` changed (None: no variant).
        planted: The changes in ``planted_path``.
        make_live: ``"module:function"`` rebuilding the live objects (None: no live check).
        tied: Tied name -> the name the checkpoint holds.
        skip: Why this case could not be built here (None: built).
        extra: Library-specific facts for its tests.
    """

    name: str
    library: str
    path: str
    expected_layout: str
    model_keys: list[str] = field(default_factory=list)
    optim_tensor_keys: list[str] = field(default_factory=list)
    non_tensor_keys: list[str] = field(default_factory=list)
    planted_path: str | None = None
    planted: list[Planted] = field(default_factory=list)
    make_live: str | None = None
    tied: dict[str, str] = field(default_factory=dict)
    skip: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_keys(self) -> list[str]:
        """Every tensor the checkpoint stores, by canonical name."""
        return self.model_keys + self.optim_tensor_keys

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``from_json`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Case:
        """The Case written by ``to_json``."""
        d = dict(d)
        d["planted"] = [Planted(p["key"], tuple(p["index"]), p["what"]) for p in d["planted"]]
        return cls(**d)


def write_cases(path: Path, cases: list[Case]) -> None:
    """Writes cases as JSON (one list)."""
    path.write_text(json.dumps([c.to_json() for c in cases], indent=1))


def read_cases(path: Path) -> dict[str, Case]:
    """Cases written by ``write_cases``, by name."""
    return {d["name"]: Case.from_json(d) for d in json.loads(path.read_text())}


@dataclass(frozen=True)
class Cases:
    """What one builder module writes, exported as its ``CASES``.

    Attributes:
        library: Its name in the corpus (the folder it builds into; the name a skipped build
            is reported under).
        requires: The module a missing install shows up as (the build is skipped without it).
        layout: The layout fsdpcheck must recognise (of a skipped build's case).
        names: The case names it writes.
        live: Those of `names` that carry a live check (``Case.make_live``).
        dist: Built by the one two-rank launch (``build(rank, world, root)`` in
            ``build_dist``); False: in the test process (``build(root)``).
        order: Builders run in this order in their launch (the order they were added in: what
            one library's import leaves in the process, the later builders meet).
    """

    library: str
    requires: str
    layout: str
    names: tuple[str, ...]
    live: tuple[str, ...] = ()
    dist: bool = True
    order: int = 0
    #: The builder module's ``build`` (``"module:build"``), filled in by ``collect``.
    target: str = ""


def collect() -> list[Cases]:
    """Every builder module's ``CASES``, in build order (multi-rank builders first)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        cases = getattr(module, "CASES", None)
        if isinstance(cases, Cases):
            target = f"{module.__name__}:build"
            found.append(replace(cases, target=target))
    return sorted(found, key=lambda c: (not c.dist, c.order, c.library))


def resolve(target: str) -> Any:
    """The object named ``"module:attr"``."""
    module, attr = target.rsplit(":", 1)
    return getattr(importlib.import_module(module), attr)


def unwrap(name: str) -> str:
    """A key with every wrapper prefix removed, wherever it occurs (a pure reference)."""
    changed = True
    while changed:
        changed = False
        for w in WRAPPERS:
            if name.startswith(w):
                name, changed = name[len(w) :], True
            if "." + w in name:
                name, changed = name.replace("." + w, "."), True
    return name


def optim_keys(
    fqns: list[str], names: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "step")
) -> list[str]:
    """Canonical optimizer-state names for Adam-style state over `fqns`."""
    return [f"optim.state.{f}.{n}" for f in fqns for n in names]


# ------------------------------------------------------------------------------------------
# The toy model every multi-rank library trains (torchtitan's own Llama needs triton).
VOCAB, DIM = 10, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class ToyNet(torch.nn.Module):
    """Embedding, two blocks, a norm and a bias-free head: 8 parameters, uneven-free rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


TOY_FQNS = [
    "embed.weight",
    "layers.0.proj.weight",
    "layers.0.proj.bias",
    "layers.1.proj.weight",
    "layers.1.proj.bias",
    "norm.weight",
    "norm.bias",
    "head.weight",
]


def toy_model(seed: int = 0) -> ToyNet:
    """The toy model with weights that depend only on `seed`."""
    torch.manual_seed(seed)
    return ToyNet()


def toy_batch(rank: int, step: int) -> torch.Tensor:
    """A rank's token batch for `step` (deterministic, different per rank)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (4, 5), generator=g)


def shard_toy(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    """FSDP2 on each block and the root, as torchtitan and Lightning examples do."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ------------------------------------------------------------------------------------------
# Planting and restoring one element, wherever it lives (plain tensor or DTensor shard).
def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offset)
    return t, (0,) * t.dim()


def set_element(t: torch.Tensor, index: tuple[int, ...], value: float | None) -> float | None:
    """Sets element `index` (global) where this rank holds it; returns the old value.

    With `value` None only reads. Ranks that do not hold the element return None.
    """
    local, offset = _local_box(t)
    rel = tuple(i - o for i, o in zip(index, offset))
    if any(r < 0 or r >= s for r, s in zip(rel, local.shape)):
        return None
    with torch.no_grad():
        old = float(local[rel])
        if value is not None:
            local[rel] = value
    return old


def bump(t: torch.Tensor, index: tuple[int, ...], delta: float = 0.5) -> float | None:
    """Adds `delta` to one element; returns the old value for ``set_element`` to restore."""
    old = set_element(t, index, None)
    if old is not None:
        set_element(t, index, old + delta)
    return old


def optim_state(model: torch.nn.Module, optimizer: Any, fqn: str, name: str) -> torch.Tensor:
    """The optimizer state tensor `name` of parameter `fqn`, through any optimizer wrapper."""
    param = model.get_parameter(fqn)
    for opt in _optimizers(optimizer):
        if param in opt.state:
            return opt.state[param][name]
    raise KeyError(f"{fqn}: no optimizer state in {type(optimizer).__name__} (not stepped yet?)")


@contextlib.contextmanager
def plant(
    model: torch.nn.Module,
    weight: WeightSpot,
    optimizer: Any = None,
    moment: MomentSpot | None = None,
) -> Iterator[None]:
    """Inside the block one weight element (and one optimizer moment) is 0.5 higher.

    Saving inside the block writes the planted twin with the library's own code; afterwards
    every element is set back to its exact old value (also when the save raises), so the live
    objects are the clean ones again. Ranks that do not hold an element change nothing there.

    Args:
        model: The bare module, whose parameter names are the canonical FQNs.
        weight: Where the weight element is.
        optimizer: What holds the moment (any wrapper ``_optimizers`` sees through).
        moment: Where the optimizer moment is; None plants the weight alone.
    """
    targets: list[tuple[torch.Tensor, tuple[int, ...]]] = [
        (model.get_parameter(weight[0]), weight[1])
    ]
    if moment is not None:
        targets.append((optim_state(model, optimizer, moment[0], moment[1]), moment[2]))
    olds = [bump(t, index) for t, index in targets]
    try:
        yield
    finally:
        for (t, index), old in zip(targets, olds):
            set_element(t, index, old)


def toy_case(
    name: str,
    library: str,
    layout: str,
    clean: Path,
    planted: Path,
    weight: WeightSpot,
    moment: MomentSpot | None = None,
    **fields: Any,
) -> Case:
    """The Case of a toy-model checkpoint and its twin saved inside ``plant(weight, moment)``.

    Args:
        name: The case id.
        library: The library (and version) whose save code wrote it.
        layout: The layout fsdpcheck must recognise.
        clean: The clean checkpoint.
        planted: The planted twin.
        weight: The planted weight element.
        moment: The planted Adam moment: the checkpoint also holds the AdamW state of every
            parameter. None: a model-only checkpoint.
        **fields: Any other ``Case`` field (``make_live``, ``non_tensor_keys``, ``extra`` ...).
    """
    changes = [Planted(weight[0], weight[1], "weight")]
    if moment is not None:
        fields.setdefault("optim_tensor_keys", sorted(optim_keys(TOY_FQNS)))
        changes.append(Planted(f"optim.state.{moment[0]}.{moment[1]}", moment[2], "moment"))
    return Case(
        name=name,
        library=library,
        path=str(clean),
        expected_layout=layout,
        model_keys=sorted(TOY_FQNS),
        planted_path=str(planted),
        planted=changes,
        **fields,
    )


# ------------------------------------------------------------------------------------------
# Read-only by construction: everything a checker could change, fingerprinted.
def _local(t: torch.Tensor) -> torch.Tensor:
    return _local_box(t)[0]


def snapshot(model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Fingerprints of every parameter, gradient, buffer and optimizer state tensor.

    Computed on this rank's local shards with ``fsdpcheck.fingerprint_tensor``, plus the
    optimizer's state size per optimizer (so lazily created state shows up as a change).
    """
    from fsdpcheck import fingerprint_tensor

    out: dict[str, Any] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[f"param:{n}"] = fingerprint_tensor(_local(p.detach()))
        out[f"grad:{n}"] = None if p.grad is None else fingerprint_tensor(_local(p.grad))
    for n, b in model.named_buffers(remove_duplicate=False):
        out[f"buffer:{n}"] = fingerprint_tensor(_local(b))
    for i, opt in enumerate(_optimizers(optimizer)):
        out[f"optim{i}:n_state"] = len(opt.state)
        for j, (param, st) in enumerate(opt.state.items()):
            out[f"optim{i}:{j}:param"] = fingerprint_tensor(_local(param.detach()))
            for k, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    out[f"optim{i}:{j}:{k}"] = fingerprint_tensor(_local(v))
                else:
                    out[f"optim{i}:{j}:{k}"] = repr(v)
        out[f"optim{i}:groups"] = repr(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        )
    return out


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside any wrapper (torchtitan, Fabric, accelerate, plain)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "optimizers") and isinstance(optimizer.optimizers, list):
        return [o for x in optimizer.optimizers for o in _optimizers(x)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        return _optimizers(inner)
    return [optimizer]


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names whose fingerprint differs (or appeared / disappeared) between two snapshots."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
