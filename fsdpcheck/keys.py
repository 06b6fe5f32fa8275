"""The checkpoint side of the key model: every entry sorted into a role under a canonical name.

``checkpoint_keys(source)`` is the one place a checkpoint's own keys are read: each part of the
checkpoint by its layout's key grammar (``fsdpcheck.formats``: containers, the optimizer-key
order, wrapper prefixes) and its role (a Trainer's ``optimizer.pt`` is optimizer state whatever
its keys look like; a weights file holds model tensors only). ``resolve_ids`` is the one place
the integer ids of a raw ``optimizer.state_dict()`` are mapped to parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdpcheck.formats import grammar_of, layout_named
from fsdpcheck.formats.base import DEFAULT_GRAMMAR, KeyGrammar
from fsdpcheck.names import canonicalizer, group_key, optim_key
from fsdpcheck.sources.base import Entry

if TYPE_CHECKING:
    from fsdpcheck.sources.base import Source


class CkptKey:
    """One checkpoint entry with its role (immutable).

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
        raw: For model, state and group: the name, parameter or group as the checkpoint spells
            it (before canonicalisation), to address the checkpoint in its own names.
        container: The top-level container the entry sits in ("" when flat).

    NOTE: [per-key rows] One row per entry, a million in large checkpoints: the fields that are
    empty for most rows (a model tensor whose raw name is its name, in no container) are held
    as one tuple only when one of them is not, so a row is four slots (64 bytes), not eight.
    """

    __slots__ = ("_rest", "entry", "name", "role")

    entry: Entry
    role: str
    name: str
    _rest: tuple[str, str, int, str, str] | None

    def __init__(
        self,
        entry: Entry,
        role: str,
        name: str,
        fqn: str = "",
        item: str = "",
        optimizer: int = 0,
        raw: str = "",
        container: str = "",
    ) -> None:
        plain = not fqn and not item and not optimizer and not container
        plain = plain and raw == (name if role == "model" else "")
        object.__setattr__(self, "entry", entry)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_rest", None if plain else (fqn, item, optimizer, raw, container))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CkptKey is immutable (cannot set {name})")

    @property
    def fqn(self) -> str:
        """See the class docstring."""
        return self._rest[0] if self._rest else ""

    @property
    def item(self) -> str:
        """See the class docstring."""
        return self._rest[1] if self._rest else ""

    @property
    def optimizer(self) -> int:
        """See the class docstring."""
        return self._rest[2] if self._rest else 0

    @property
    def raw(self) -> str:
        """See the class docstring."""
        if self._rest:
            return self._rest[3]
        return self.name if self.role == "model" else ""

    @property
    def container(self) -> str:
        """See the class docstring."""
        return self._rest[4] if self._rest else ""

    @property
    def key(self) -> str:
        """The checkpoint's own key."""
        return self.entry.key

    def _fields(self) -> tuple[Any, ...]:
        return (self.entry, self.role, self.name, self.fqn, self.item, self.optimizer, self.raw,
                self.container)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CkptKey):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        names = ("entry", "role", "name", "fqn", "item", "optimizer", "raw", "container")
        return "CkptKey(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields())) + ")"


@dataclass
class CheckpointKeys:
    """Every entry of a checkpoint, by role, under canonical names.

    Attributes:
        rows: Every entry.
        model: Canonical FQN -> model tensor entry.
        state: (parameter FQN or integer id, state name) -> optimizer state entry.
        groups: Group index (or FQN, see `groups_by_fqn`) -> hyperparameter name -> entry.
        other: Training state that is neither model nor optimizer.
        id_keyed: Optimizer state keyed by integer ids (a raw ``optimizer.state_dict()``).
        groups_by_fqn: Hyperparameters flattened per parameter FQN (torchtitan).
        adapter: The model tensors are an adapter's (PEFT): the base model's are not stored.
        placeholders: Checkpoint key -> why the entry stands for values stored elsewhere
            (DeepSpeed ZeRO-3's empty stand-ins): named as skipped, never compared.
        layouts: The layouts of the parts read.
    """

    rows: list[CkptKey] = field(default_factory=list)
    model: dict[str, CkptKey] = field(default_factory=dict)
    state: dict[tuple[str, str], CkptKey] = field(default_factory=dict)
    groups: dict[str, dict[str, CkptKey]] = field(default_factory=dict)
    other: list[CkptKey] = field(default_factory=list)
    id_keyed: bool = False
    groups_by_fqn: bool = False
    adapter: bool = False
    placeholders: dict[str, str] = field(default_factory=dict)
    layouts: list[str] = field(default_factory=list)

    def tensors(self) -> list[CkptKey]:
        """Every tensor entry."""
        return [r for r in self.rows if r.entry.is_tensor]

    def tensor_count(self) -> int:
        """How many tensor entries (without listing them)."""
        return sum(1 for r in self.rows if r.entry.is_tensor)

    def by_name(self) -> dict[str, CkptKey]:
        """Canonical name -> key, for the tensors (model and optimizer state and other)."""
        return {r.name: r for r in self.tensors()}

    def by_key(self) -> dict[str, CkptKey]:
        """The checkpoint's own key -> its row."""
        return {r.key: r for r in self.rows}


def checkpoint_keys(source: Source) -> CheckpointKeys:
    """Sorts a checkpoint's entries into roles and gives each its canonical name.

    Each part of a merged checkpoint is read by its own layout's grammar and role, then the
    parts are put together (a Trainer's weights file and its ``optimizer.pt``, a list the user
    passed).
    """
    parts = source.parts()
    out = CheckpointKeys()
    for part in parts:
        layout = part.checkpoint.layout if part.checkpoint is not None else ""
        keys = keys_from_entries(
            part.entries(),
            grammar=grammar_of(layout),
            flat=part.flat_names,
            role=part.role,
        )
        recognised = layout_named(layout)
        if recognised is not None and part.checkpoint is not None:
            for r in keys.model.values():
                why = recognised.placeholder(part.checkpoint, r.entry.shape)
                if why is not None:
                    keys.placeholders[r.key] = why
        keys.layouts = [layout] if layout else []
        merge_into(out, keys)
    return out


def merge_into(out: CheckpointKeys, keys: CheckpointKeys) -> None:
    """Adds one part's keys to `out` (the parts of one checkpoint)."""
    out.rows += keys.rows
    out.model.update(keys.model)
    out.state.update(keys.state)
    for g, names in keys.groups.items():
        out.groups.setdefault(g, {}).update(names)
    out.other += keys.other
    out.id_keyed = out.id_keyed or keys.id_keyed
    out.groups_by_fqn = out.groups_by_fqn or keys.groups_by_fqn
    out.adapter = out.adapter or keys.adapter
    out.placeholders.update(keys.placeholders)
    out.layouts += [n for n in keys.layouts if n not in out.layouts]


def keys_from_entries(
    entries: Mapping[str, Entry],
    *,
    grammar: KeyGrammar = DEFAULT_GRAMMAR,
    flat: bool = False,
    role: str = "any",
) -> CheckpointKeys:
    """The CheckpointKeys of one part's entries.

    Args:
        entries: The part's entries (structural paths decide; flat keys fall back to the
            ``[optim.]state.<fqn>.<name>`` / ``param_groups.<i>.<name>`` shapes).
        grammar: The layout's key grammar.
        flat: The format has no nesting (safetensors): every key is one name, dots included.
        role: "model" / "adapter" (every tensor is a model tensor), "optimizer" (optimizer
            state and hyperparameters; anything else is training state) or "any".
    """
    out = CheckpointKeys(adapter=role == "adapter")

    # NOTE: [per-key rows] A flat name is its own one-component path: made when needed, not
    # kept in a map of tuples; model entries are gathered as two lists (entry, raw name), not a
    # tuple each (a million safetensors entries: ~170 bytes a key less at the peak).
    def path_of(e: Entry) -> tuple[str, ...]:
        return (e.key,) if flat else e.path

    containers = grammar.model_containers
    has_model_container = not flat and any(
        len(e.path) > 1 and e.path[0] in containers for e in entries.values()
    )
    model_entries: list[Entry] = []
    model_raw: list[str] = []
    state_raw: list[tuple[Entry, str, str, int]] = []
    group_raw: list[tuple[Entry, str, str, int]] = []
    for key in sorted(entries):
        e = entries[key]
        p = path_of(e)
        if role in ("model", "adapter"):
            if e.is_tensor:
                inner = p[1:] if len(p) > 1 and p[0] in containers else p
                model_entries.append(e)
                model_raw.append(".".join(inner))
            else:
                out.other.append(CkptKey(e, "other", e.key))
            continue
        found = grammar.optim_path(p)
        if found is not None:
            target = state_raw if found.kind == "state" else group_raw
            target.append((e, found.who, found.item, found.optimizer))
        elif role == "optimizer":
            out.other.append(CkptKey(e, "other", e.key))
        elif len(p) > 1 and p[0] in containers:
            model_entries.append(e)
            model_raw.append(".".join(p[1:]))
        elif len(p) == 1 and not has_model_container and e.is_tensor:
            model_entries.append(e)
            model_raw.append(p[0])
        else:
            out.other.append(CkptKey(e, "other", e.key))
    canon = canonicalizer(model_raw or [w for _, w, _, _ in state_raw], grammar.wrapper_prefixes)
    for e, raw in zip(model_entries, model_raw):
        name = canon(raw)
        row = CkptKey(e, "model", name, raw=raw, container=grammar.top(path_of(e)))
        if e.is_tensor:
            out.model[name] = row
        out.rows.append(row)
    del model_entries, model_raw
    whos = {w for _, w, _, _ in state_raw}
    out.id_keyed = bool(whos) and all(w.isdigit() for w in whos)
    for e, who, item, index in state_raw:
        fqn = who if out.id_keyed else canon(who)
        top = grammar.top(path_of(e))
        row = CkptKey(e, "state", optim_key(fqn, item), fqn, item, index, who, top)
        out.state[(fqn, item)] = row
        out.rows.append(row)
    gids = {w for _, w, _, _ in group_raw}
    out.groups_by_fqn = bool(gids) and not all(g.isdigit() for g in gids)
    for e, who, item, index in group_raw:
        g = who if not out.groups_by_fqn else canon(who)
        top = grammar.top(path_of(e))
        row = CkptKey(e, "group", group_key(g, item), g, item, index, who, top)
        out.groups.setdefault(g, {})[item] = row
        out.rows.append(row)
    out.rows += out.other
    return out


# -------------------------------------------------------------------------------------------
@dataclass
class IdMap:
    """Integer ids of a raw ``optimizer.state_dict()`` mapped to parameter names.

    Attributes:
        ids: Id (as the checkpoint spells it) -> parameter FQN.
        error: Why the ids cannot be mapped (one line), or "".
    """

    ids: dict[str, str] = field(default_factory=dict)
    error: str = ""


def group_params(
    keys: CheckpointKeys, read_objects: Callable[[list[str]], dict[str, Any]]
) -> list[list[str]] | None:
    """Each param group's ``params`` list, in group order, as the checkpoint spells them.

    None when the checkpoint has no per-group ``params`` lists (flattened hyperparameters).
    """
    if keys.groups_by_fqn:
        return None
    params = {g: hp["params"].key for g, hp in keys.groups.items() if "params" in hp}
    if not params:
        return None
    saved = read_objects(list(params.values()))
    ordered = sorted(params, key=lambda g: (len(g), g))  # "10" after "9"
    return [[str(p) for p in _as_list(saved[params[g]])] for g in ordered]


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def resolve_ids(
    keys: CheckpointKeys,
    read_objects: Callable[[list[str]], dict[str, Any]],
    order: Sequence[str],
) -> IdMap:
    """The integer-id rule, written once: ids in param_groups order are parameters in `order`.

    A raw ``optimizer.state_dict()`` keys its state by each parameter's position in the
    concatenation of its param_groups' ``params`` lists; the same position in the live
    optimizer's (or the other checkpoint's) groups names the parameter.

    Args:
        keys: The id-keyed checkpoint.
        read_objects: Reads its non-tensor entries (the ``params`` lists).
        order: Parameter FQNs in the other side's param_groups order.
    """
    lists = group_params(keys, read_objects)
    if lists is None:
        return IdMap(error="the checkpoint's param_groups hold no params lists to map ids by")
    ids = [p for ps in lists for p in ps]
    if len(ids) != len(order):
        return IdMap(
            error=f"the checkpoint's optimizer state is keyed by integer ids for {len(ids)} "
            f"parameters but the other side has {len(order)}: the ids cannot be mapped to "
            "parameters"
        )
    return IdMap(dict(zip(ids, order)))


def non_tensor_note(keys: CheckpointKeys, side: str = "the checkpoint") -> str | None:
    """One line naming the non-tensor training state a side holds, or None.

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


__all__ = [
    "CheckpointKeys",
    "CkptKey",
    "IdMap",
    "checkpoint_keys",
    "group_params",
    "keys_from_entries",
    "merge_into",
    "non_tensor_note",
    "resolve_ids",
]
