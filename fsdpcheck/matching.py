"""The key model: which checkpoint entry and which live tensor name the same thing.

Every entry point (verify, load, save, compare, fingerprint, fingerprint_checkpoint, audit,
inspect) names tensors the same way, through this module only:

- model tensors by their canonical FQN: the name the unwrapped model gives them. Wrapper
  components (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod``) are
  removed wherever they appear; leading wrapper prefixes (``module.`` of DDP/DeepSpeed,
  ``_forward_module.`` of Lightning, ``_orig_mod.`` of torch.compile) are removed while every
  model name of that side carries them. A prefix that is part of the model's own FQNs (``model.``
  of a Hugging Face ``*ForCausalLM``) is never removed: a checkpoint's containers are recognised
  from its structure (nested dicts, DCP's planner data), never from dots inside a name.
- optimizer state as ``optim.state.<fqn>.<name>``, hyperparameters as
  ``optim.param_groups.<i>.<name>``.

The result of matching is data: a list of MappingRow (side A key, side B key, status, reason)
that reports carry and ``fsdpcheck inspect --show-mapping`` prints.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck.report import Finding, MappingRow
from fsdpcheck.sources.base import Entry

if TYPE_CHECKING:
    from fsdpcheck.live import LiveState

# Components that wrappers insert anywhere in a name; never part of a real model's FQNs.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Leading components that wrappers put before every name (DDP/DeepSpeed, Lightning, compile).
WRAPPER_PREFIXES = ("module", "_forward_module", "_orig_mod")

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

KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]


def optim_key(fqn: str, name: str) -> str:
    """The canonical name of an optimizer state entry."""
    return f"optim.state.{fqn}.{name}"


def group_key(index: int | str, name: str) -> str:
    """The canonical name of a param_groups hyperparameter."""
    return f"optim.param_groups.{index}.{name}"


def canonical_names(names: Iterable[str]) -> dict[str, str]:
    """Original name -> canonical FQN, for the model names of ONE side.

    Interior wrapper components go; a leading wrapper prefix goes only while every name has it
    (so a model whose own top-level module happens to be called ``module`` on both sides still
    matches, and ``model.`` is never touched).
    """
    parts = {n: [c for c in n.split(".") if c not in WRAPPER_COMPONENTS] for n in names}
    while parts:
        heads = {p[0] if len(p) > 1 else None for p in parts.values()}
        if len(heads) != 1:
            break
        (head,) = heads
        if head not in WRAPPER_PREFIXES:
            break
        parts = {n: p[1:] for n, p in parts.items()}
    return {n: ".".join(p) for n, p in parts.items()}


def canonicalizer(model_names: Iterable[str]) -> Callable[[str], str]:
    """A function that canonicalises any name of the side whose model names are given.

    Optimizer FQNs are a subset of the model's names: they get the same treatment, decided by
    the model names (so Lightning's ``_forward_module.`` goes from model AND optimizer keys).
    """
    names = list(model_names)
    mapping = canonical_names(names)
    stripped = _stripped_prefix(names, mapping)

    def canon(name: str) -> str:
        if name in mapping:
            return mapping[name]
        parts = [c for c in name.split(".") if c not in WRAPPER_COMPONENTS]
        k = len(stripped)
        if k and parts[:k] == stripped and len(parts) > k:
            parts = parts[k:]
        return ".".join(parts)

    return canon


def _stripped_prefix(names: list[str], mapping: dict[str, str]) -> list[str]:
    for n in names:
        parts = [c for c in n.split(".") if c not in WRAPPER_COMPONENTS]
        k = len(parts) - len(mapping[n].split("."))
        return parts[:k]
    return []


# -------------------------------------------------------------------------------------------
# The checkpoint side.
@dataclass(frozen=True)
class CkptKey:
    """One checkpoint entry with its role.

    Attributes:
        entry: The source's entry (its own key, structural path, shape, dtype).
        role: "model", "state" (optimizer state), "group" (a hyperparameter) or "other"
            (training state that is neither: lr_scheduler, dataloader, train_state, counters).
        name: The canonical name (model FQN, ``optim.state.<fqn>.<name>``,
            ``optim.param_groups.<g>.<name>``; the checkpoint key for "other").
        fqn: For state: the parameter as the checkpoint names it (canonical FQN, or an integer
            id of a raw ``optimizer.state_dict()``). For group: the group index, or the FQN of
            torchtitan's flattened per-parameter hyperparameters.
        item: The state or hyperparameter name.
        optimizer: Index of the optimizer when a checkpoint holds a list of them.
        raw: For state and group: the parameter or group as the checkpoint spells it (before
            canonicalisation), to address the checkpoint in its own names.
        container: The top-level container the entry sits in ("" when flat).
    """

    entry: Entry
    role: str
    name: str
    fqn: str = ""
    item: str = ""
    optimizer: int = 0
    raw: str = ""
    container: str = ""

    @property
    def key(self) -> str:
        """The checkpoint's own key."""
        return self.entry.key


@dataclass
class CheckpointKeys:
    """Every entry of a checkpoint, by role, under canonical names."""

    rows: list[CkptKey] = field(default_factory=list)
    model: dict[str, CkptKey] = field(default_factory=dict)  # canonical fqn -> key
    state: dict[tuple[str, str], CkptKey] = field(default_factory=dict)  # (fqn/id, name)
    groups: dict[str, dict[str, CkptKey]] = field(default_factory=dict)  # group -> name -> key
    other: list[CkptKey] = field(default_factory=list)
    #: Optimizer state keyed by integer ids (a raw ``optimizer.state_dict()``).
    id_keyed: bool = False
    #: Hyperparameters flattened per parameter FQN (torchtitan), not per group index.
    groups_by_fqn: bool = False

    def tensors(self) -> list[CkptKey]:
        """Every tensor entry."""
        return [r for r in self.rows if r.entry.is_tensor]

    def by_name(self) -> dict[str, CkptKey]:
        """Canonical name -> key, for the tensors (model and optimizer state and other)."""
        return {r.name: r for r in self.tensors()}


def checkpoint_keys(entries: Mapping[str, Entry], *, flat: bool = False) -> CheckpointKeys:
    """Sorts a checkpoint's entries into roles and gives each its canonical name.

    Args:
        entries: The source's entries (structural paths decide; flat keys fall back to the
            ``[optim.]state.<fqn>.<name>`` / ``param_groups.<i>.<name>`` shapes).
        flat: The format has no nesting (safetensors): every key is one name, dots included.
    """
    out = CheckpointKeys()
    paths = {e.key: ((e.key,) if flat else e.path) for e in entries.values()}
    has_model_container = any(len(p) > 1 and p[0] in MODEL_CONTAINERS for p in paths.values())
    model_raw: list[tuple[Entry, str]] = []
    state_raw: list[tuple[Entry, str, str, int]] = []
    group_raw: list[tuple[Entry, str, str, int]] = []
    for key in sorted(entries):
        e = entries[key]
        p = paths[e.key]
        role = _optim_role(p)
        if role is not None:
            kind, who, item, index = role
            (state_raw if kind == "state" else group_raw).append((e, who, item, index))
        elif len(p) > 1 and p[0] in MODEL_CONTAINERS:
            model_raw.append((e, ".".join(p[1:])))
        elif len(p) == 1 and not has_model_container and e.is_tensor:
            model_raw.append((e, p[0]))
        else:
            out.other.append(CkptKey(e, "other", e.key))
    canon = canonicalizer([n for _, n in model_raw] or [w for _, w, _, _ in state_raw])
    for e, raw in model_raw:
        name = canon(raw)
        row = CkptKey(e, "model", name, raw=raw, container=_top(paths, e))
        if e.is_tensor:
            out.model[name] = row
        out.rows.append(row)
    whos = {w for _, w, _, _ in state_raw}
    out.id_keyed = bool(whos) and all(w.isdigit() for w in whos)
    for e, who, item, index in state_raw:
        fqn = who if out.id_keyed else canon(who)
        row = CkptKey(e, "state", optim_key(fqn, item), fqn, item, index, who, _top(paths, e))
        out.state[(fqn, item)] = row
        out.rows.append(row)
    gids = {w for _, w, _, _ in group_raw}
    out.groups_by_fqn = bool(gids) and not all(g.isdigit() for g in gids)
    for e, who, item, index in group_raw:
        g = who if not out.groups_by_fqn else canon(who)
        row = CkptKey(e, "group", group_key(g, item), g, item, index, who, _top(paths, e))
        out.groups.setdefault(g, {})[item] = row
        out.rows.append(row)
    out.rows += out.other
    return out


def _top(paths: Mapping[str, tuple[str, ...]], e: Entry) -> str:
    p = paths[e.key]
    if len(p) > 1 and (
        p[0] in MODEL_CONTAINERS or p[0] in OPTIM_CONTAINERS or _NUMBERED_OPTIM.match(p[0])
    ):
        return p[0]
    return ""


def _optim_role(p: tuple[str, ...]) -> tuple[str, str, str, int] | None:
    """("state" | "group", fqn or group, name, optimizer index) of an optimizer entry, or None."""
    rest, index = p, 0
    numbered = _NUMBERED_OPTIM.match(rest[0]) if len(rest) > 1 else None
    if numbered:  # optimizer_<i>: Lightning's ModelParallelStrategy saves optimizer i there
        index, rest = int(numbered.group(1)), rest[1:]
    elif len(rest) > 1 and rest[0] in OPTIM_CONTAINERS:
        rest = rest[1:]
        if len(rest) > 1 and rest[0].isdigit():  # a list of optimizers (Lightning .ckpt)
            index, rest = int(rest[0]), rest[1:]
    elif len(rest) == 1 and "." in rest[0]:
        head, _, tail = rest[0].partition(".")
        if head in OPTIM_CONTAINERS:
            rest = (tail,)
    if len(rest) == 3 and rest[0] == "state":
        return ("state", rest[1], rest[2], index)
    if len(rest) == 3 and rest[0] == "param_groups":
        return ("group", rest[1], rest[2], index)
    if len(rest) == 1:
        m = _FLAT_STATE.match(rest[0])
        if m:
            return ("state", m.group(1), m.group(2), index)
        m = _FLAT_GROUP.match(rest[0])
        if m:
            return ("group", m.group(1), m.group(2), index)
    return None


def prefix_pair(a: Iterable[str], b: Iterable[str]) -> tuple[str, str]:
    """(strip, add): the one prefix change that turns the most names of `a` into names of `b`.

    For checkpoints that put every model name under one extra prefix that is not a container
    (a wrapper module saved flat: ``model.0.weight`` for a live ``0.weight``), and the reverse.
    ("", "") unless a prefix change matches strictly more names than none does; names that match
    exactly never use it.
    """
    a_set, b_set = set(a), set(b)
    exact = len(a_set & b_set)
    candidates: set[tuple[str, str]] = set()
    for x in sorted(a_set)[:64]:
        for y in b_set:
            if y != x and y.endswith("." + x):
                candidates.add(("", y[: len(y) - len(x)]))
            elif y != x and x.endswith("." + y):
                candidates.add((x[: len(x) - len(y)], ""))
    best, best_score = ("", ""), exact
    for strip, add in sorted(candidates):
        score = sum(1 for x in a_set if x.startswith(strip) and add + x[len(strip) :] in b_set)
        if score > best_score:
            best, best_score = (strip, add), score
    return best


def with_prefix(pair: tuple[str, str], name: str) -> str:
    """A name of side a under a prefix_pair result."""
    strip, add = pair
    return add + (name[len(strip) :] if name.startswith(strip) else name)


def non_tensor_note(keys: CheckpointKeys, side: str = "the checkpoint") -> str | None:
    """Names the non-tensor training state (lr_scheduler, dataloader, ...) nothing compares.

    Grouped by top-level entry, so that a torchtitan step names ``lr_scheduler``, ``dataloader``
    and ``train_state`` whatever they hold inside.
    """
    groups: dict[str, int] = {}
    for r in keys.other:
        if not r.entry.is_tensor:
            top = r.entry.path[0] if len(r.entry.path) > 1 else r.key
            groups[top] = groups.get(top, 0) + 1
    if not groups:
        return None
    named = ", ".join(f"{g} ({n})" if n > 1 else g for g, n in sorted(groups.items()))
    total = sum(groups.values())
    return f"{side} holds {total} non-tensor entries that are not compared: {named}"


# -------------------------------------------------------------------------------------------
# User choices: ignore patterns and key maps.
def is_ignored(patterns: Sequence[str] | None, *names: str | None) -> bool:
    """Whether any of the names matches any fnmatch pattern."""
    if not patterns:
        return False
    return any(n is not None and fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def apply_key_map(key_map: KeyMap | None, key: str, default: str | None) -> str | None:
    """The checkpoint key of a live key under a user key_map (None: not checked)."""
    if key_map is None:
        return default
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, default)


def mapped_to_none(key_map: KeyMap | None, key: str) -> bool:
    """Whether the user's key_map says not to check `key` (maps it to None)."""
    # A default that is not None tells "no entry" (use the detected name) from "None".
    return key_map is not None and apply_key_map(key_map, key, "") is None


# -------------------------------------------------------------------------------------------
# Checkpoint against checkpoint (compare).
@dataclass
class PairMatch:
    """Two checkpoints' tensors paired by canonical name."""

    pairs: list[tuple[str, CkptKey, CkptKey]] = field(default_factory=list)
    only_a: list[CkptKey] = field(default_factory=list)
    only_b: list[CkptKey] = field(default_factory=list)
    ignored: list[MappingRow] = field(default_factory=list)

    def rows(self) -> list[MappingRow]:
        """The mapping table."""
        rows = [MappingRow(n, b.key, "compared") for n, _, b in self.pairs]
        rows += [MappingRow(a.name, None, "unexpected", "only in actual") for a in self.only_a]
        rows += [MappingRow(None, b.key, "missing", "only in expected") for b in self.only_b]
        return sorted(rows + self.ignored, key=lambda r: r.a or r.b or "")


def match_checkpoints(
    a: CheckpointKeys, b: CheckpointKeys, ignore: Sequence[str] | None = None
) -> PairMatch:
    """Pairs the tensors of two checkpoints by canonical name (every tensor lands somewhere)."""
    out = PairMatch()
    ta, tb = a.by_name(), b.by_name()
    for name in sorted(set(ta) | set(tb)):
        ka, kb = ta.get(name), tb.get(name)
        if is_ignored(ignore, name, ka.key if ka else None, kb.key if kb else None):
            out.ignored.append(
                MappingRow(name, kb.key if kb else None, "ignored", "excluded by the user")
            )
        elif ka is not None and kb is not None:
            out.pairs.append((name, ka, kb))
        elif ka is not None:
            out.only_a.append(ka)
        elif kb is not None:
            out.only_b.append(kb)
    return out


# -------------------------------------------------------------------------------------------
# The live model against a checkpoint (verify).
@dataclass
class LiveItem:
    """One live tensor matched with the checkpoint entry it is checked against."""

    key: str  # canonical live key (model FQN or optim.state.<fqn>.<name>)
    fqn: str  # the parameter's FQN (== key for model tensors)
    value: Any
    ckpt_key: str
    is_param_state: bool = False  # optimizer state (not a model tensor)


@dataclass
class GroupPair:
    """A live param group and where the checkpoint keeps its hyperparameters."""

    index: int
    hparams: dict[str, Any]
    ckpt: dict[str, CkptKey] | None  # name -> entry; None when no checkpoint group matches


@dataclass
class LiveMatch:
    """The result of matching a live model (and optimizer) with a checkpoint."""

    items: list[LiveItem] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rows: list[MappingRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    groups: list[GroupPair] = field(default_factory=list)
    keys_a: int = 0
    keys_b: int = 0


def match_live(
    live: LiveState,
    ckpt: CheckpointKeys,
    *,
    read_objects: Callable[[list[str]], dict[str, Any]],
    key_map: KeyMap | None = None,
    ignore: Sequence[str] | None = None,
) -> LiveMatch:
    """Pairs every live tensor with a checkpoint entry.

    Everything else becomes a finding or a row with its reason. Deterministic: every rank
    computes the same from the same keys.

    Args:
        live: The live state (canonical names).
        ckpt: The checkpoint's keys.
        read_objects: Reads non-tensor entries (param_groups ``params`` lists, to map the
            integer ids of a raw ``optimizer.state_dict()`` to FQNs).
        key_map: Live key -> checkpoint key overrides (None: not checked).
        ignore: fnmatch patterns of keys the user excludes.
    """
    m = LiveMatch()
    used: set[str] = set()
    entry_keys = {r.key for r in ckpt.rows}
    _match_model(m, live, ckpt, key_map, ignore, used, entry_keys)
    if live.optim_state is not None:
        _match_optimizer(m, live, ckpt, read_objects, key_map, ignore, used, entry_keys)
    elif ckpt.state:
        fqns = {r.fqn for r in ckpt.state.values()}
        m.notes.append(
            f"the checkpoint holds optimizer state for {len(fqns)} parameter(s); pass "
            "optimizer= to verify it too"
        )
        for r in ckpt.state.values():
            if r.entry.is_tensor:
                used.add(r.key)
                m.rows.append(MappingRow(None, r.key, "ignored", "no optimizer passed"))
    for r in ckpt.rows:
        if r.key in used or not r.entry.is_tensor:
            continue
        if r.role == "other":
            m.rows.append(MappingRow(None, r.key, "ignored", "training state, not model/optim"))
        elif is_ignored(ignore, r.name, r.key):
            m.rows.append(MappingRow(None, r.key, "ignored", "excluded by the user"))
        else:
            m.findings.append(Finding(r.name, "unexpected", "in the checkpoint but not live"))
            m.rows.append(MappingRow(None, r.key, "unexpected", "not in the live state"))
    note = non_tensor_note(ckpt)
    if note:
        m.notes.append(note)
    m.keys_a = len(live.tensors())
    m.keys_b = len(ckpt.tensors())
    m.rows.sort(key=lambda r: r.a or r.b or "")
    return m


def _match_model(
    m: LiveMatch,
    live: LiveState,
    ckpt: CheckpointKeys,
    key_map: KeyMap | None,
    ignore: Sequence[str] | None,
    used: set[str],
    entry_keys: set[str],
) -> None:
    # Tie groups: every name of a tied parameter, first name first.
    ties: dict[str, list[str]] = {}
    for dup, first in live.tied.items():
        ties.setdefault(first, [first]).append(dup)
    group_of = {n: g for g in ties.values() for n in g}
    pair = prefix_pair(live.model, ckpt.model)
    if pair != ("", ""):
        m.notes.append(
            f"the checkpoint names model tensors with prefix {pair[1]!r} where the live model has "
            f"{pair[0] or 'none'!r}: matched that way"
        )
    for fqn in sorted(live.model):
        row = ckpt.model.get(fqn) or ckpt.model.get(with_prefix(pair, fqn))
        status, reason = "compared", ""
        if row is None and fqn in group_of:
            held = [n for n in group_of[fqn] if n in ckpt.model]
            if held:
                row, status = ckpt.model[held[0]], "tied"
                reason = f"tied to {held[0]}, which the checkpoint holds"
                m.notes.append(f"{fqn} is tied to {held[0]}: checked against {row.key}")
        default = row.key if row is not None else None
        _add_item(
            m,
            fqn,
            fqn,
            live.model[fqn],
            default,
            status,
            reason,
            key_map,
            ignore,
            used,
            entry_keys,
            False,
        )


def _add_item(
    m: LiveMatch,
    key: str,
    fqn: str,
    value: Any,
    default: str | None,
    status: str,
    reason: str,
    key_map: KeyMap | None,
    ignore: Sequence[str] | None,
    used: set[str],
    entry_keys: set[str],
    is_state: bool,
    missing_msg: str = "",
) -> None:
    ckpt_key = apply_key_map(key_map, key, default)
    if is_ignored(ignore, key, ckpt_key):
        m.rows.append(MappingRow(key, ckpt_key, "ignored", "excluded by the user"))
        if ckpt_key is not None:
            used.add(ckpt_key)
        return
    if ckpt_key is None:
        if mapped_to_none(key_map, key):
            m.rows.append(MappingRow(key, None, "ignored", "key_map maps it to None"))
            return
        m.findings.append(
            Finding(
                key,
                "missing",
                missing_msg
                or "in the live state but not in the checkpoint; pass key_map if "
                "the checkpoint names it differently, or ignore= to exclude it",
            )
        )
        m.rows.append(MappingRow(key, None, "missing", "not in the checkpoint"))
        return
    if ckpt_key not in entry_keys:
        m.findings.append(
            Finding(key, "missing", f"key_map names {ckpt_key!r}, which the checkpoint lacks")
        )
        m.rows.append(MappingRow(key, ckpt_key, "missing", "key_map target not in checkpoint"))
        return
    used.add(ckpt_key)
    m.items.append(LiveItem(key, fqn, value, ckpt_key, is_state))
    m.rows.append(MappingRow(key, ckpt_key, status, reason))


def _match_optimizer(
    m: LiveMatch,
    live: LiveState,
    ckpt: CheckpointKeys,
    read_objects: Callable[[list[str]], dict[str, Any]],
    key_map: KeyMap | None,
    ignore: Sequence[str] | None,
    used: set[str],
    entry_keys: set[str],
) -> None:
    assert live.optim_state is not None and live.param_groups is not None
    for key, kind, message in live.problems:
        m.findings.append(Finding(key, kind, message))
    order = [fqn for g in live.param_groups for fqn in g["params"]]
    # Checkpoint group id -> its params, in live FQNs.
    group_params: dict[str, list[str]] = {}
    to_live: dict[str, str] = {}  # checkpoint's parameter name (FQN or id) -> live FQN
    if ckpt.groups and not ckpt.groups_by_fqn:
        params_keys = {g: hp["params"].key for g, hp in ckpt.groups.items() if "params" in hp}
        saved = read_objects(list(params_keys.values())) if params_keys else {}
        ordered = sorted(params_keys, key=lambda g: (len(g), g))
        if ckpt.id_keyed:
            ids = [str(p) for g in ordered for p in saved[params_keys[g]]]
            if len(ids) != len(order):
                m.findings.append(
                    Finding(
                        "optim.state",
                        "error",
                        f"the checkpoint's optimizer state is keyed by integer ids for "
                        f"{len(ids)} parameters but the live optimizer has {len(order)}: the "
                        "ids cannot be mapped to parameters",
                    )
                )
            else:
                to_live = dict(zip(ids, order))
                m.notes.append(
                    "the checkpoint's optimizer state is keyed by integer ids (a raw "
                    "optimizer.state_dict()): mapped to parameters in param_groups order"
                )
        canon = canonicalizer(live.model)
        for g in ordered:
            group_params[g] = [to_live.get(str(p), canon(str(p))) for p in saved[params_keys[g]]]
    if not ckpt.id_keyed:
        to_live = {fqn: fqn for fqn, _ in ckpt.state}
    from_live = {v: k for k, v in to_live.items()}
    for fqn in sorted(live.optim_state):
        for name in sorted(live.optim_state[fqn]):
            value = live.optim_state[fqn][name]
            if not isinstance(value, torch.Tensor):
                continue  # non-tensor state (rare): nothing to compare element-wise
            key = optim_key(fqn, name)
            ck = from_live.get(fqn)
            row = ckpt.state.get((ck, name)) if ck is not None else None
            _add_item(
                m,
                key,
                fqn,
                value,
                row.key if row else None,
                "compared",
                "",
                key_map,
                ignore,
                used,
                entry_keys,
                True,
                f"optimizer state '{name}' of {fqn} is not in the checkpoint",
            )
    with_state = set(live.optim_state)
    for (ck, name), row in sorted(ckpt.state.items()):
        if row.key in used or not row.entry.is_tensor:
            continue
        used.add(row.key)
        live_fqn = to_live.get(ck)
        if is_ignored(ignore, row.name, row.key):
            m.rows.append(MappingRow(None, row.key, "ignored", "excluded by the user"))
            continue
        if live_fqn is None:
            msg = "optimizer state in the checkpoint for a parameter the model does not have"
            m.findings.append(Finding(row.name, "unexpected", msg))
            m.rows.append(MappingRow(None, row.key, "unexpected", "no such live parameter"))
        elif live_fqn not in with_state:
            msg = (
                f"the checkpoint has optimizer state '{name}' for {live_fqn} but the optimizer "
                "holds none for it (not loaded?)"
            )
            m.findings.append(Finding(optim_key(live_fqn, name), "missing", msg))
            m.rows.append(MappingRow(optim_key(live_fqn, name), row.key, "missing", "not live"))
        else:
            msg = (
                f"the checkpoint has optimizer state '{name}' for {live_fqn}; the optimizer has not"
            )
            m.findings.append(Finding(optim_key(live_fqn, name), "unexpected", msg))
            m.rows.append(MappingRow(None, row.key, "unexpected", "state name not live"))
    for gi, group in enumerate(live.param_groups):
        # param_names (torch >= 2.6 named optimizers) restates params; DCP's flattened form
        # does not save it.
        hps = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if ckpt.groups_by_fqn:
            head = group["params"][0] if group["params"] else None
            m.groups.append(GroupPair(gi, hps, ckpt.groups.get(head) if head else None))
            continue
        params = set(group["params"])
        match = next((cg for cg, ps in group_params.items() if set(ps) == params), None)
        m.groups.append(GroupPair(gi, hps, ckpt.groups[match] if match is not None else None))
        if match is None and ckpt.groups:
            m.findings.append(
                Finding(
                    group_key(gi, "params"),
                    "missing",
                    "no param group in the checkpoint has the same parameters",
                )
            )
