"""The pairing: which tensor of one side is checked against which entry of the other.

Every entry point pairs names here and nowhere else: ``verify``, ``load`` and ``save`` (the
live model against a checkpoint: ``match_live``), ``compare`` (a checkpoint against another:
``match_checkpoints``), and through them the integrations. Both run the same algorithm
(``_pair``) over two ``Side``s, so a pair verify accepts is the pair load loads and compare
compares. In order:

1. integer optimizer ids (a raw ``optimizer.state_dict()``) are mapped to parameters by the one
   rule in ``keys.resolve_ids``, with the other side's param_groups order;
2. a prefix that differs between the two sides' model names (a Lightning module's ``model.``
   against that model's own ``save_pretrained``) is found and named in a note;
3. a PEFT adapter file's names get the live adapter's name back (``lora_A.weight`` is the live
   ``lora_A.default.weight``), and the frozen base weights are named as not in an adapter file;
4. each tensor of side A is paired by the user's ``key_map``, else by canonical name (under the
   prefix), else through a tied parameter; names that need not be on side B (non-persistent
   buffers) are compared when B holds them and listed, not missing, when it does not;
5. everything left is a finding or an ignored row with its reason; optimizer state that only
   one side has at all is ONE finding (with the ``--ignore 'optim.*'`` hint), not one per tensor.

The result is data: the pairs, MappingRows (``fsdpcheck inspect --show-mapping`` prints them),
findings and notes, identical on every rank that pairs the same names.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdpcheck.keys import (
    CheckpointKeys,
    CkptKey,
    checkpoint_keys,
    group_params,
    keys_from_entries,
    non_tensor_note,
    resolve_ids,
)
from fsdpcheck.names import OPTIM_STATE, canonicalizer, group_key, optim_key
from fsdpcheck.report import Finding, MappingRow

if TYPE_CHECKING:
    from fsdpcheck.live import LiveState

#: A user's key map: side-A name -> side-B key (its own key or its canonical name), None = not
#: checked; a dict, a callable, or prefix rules from ``prefix_rules``.
KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]
ReadObjects = Callable[[list[str]], dict[str, Any]]

__all__ = [
    "CheckpointKeys",
    "CkptKey",
    "GroupPair",
    "KeyMap",
    "LiveItem",
    "LiveMatch",
    "PairMatch",
    "apply_key_map",
    "checkpoint_keys",
    "is_ignored",
    "keys_from_entries",
    "match_checkpoints",
    "match_groups",
    "match_live",
    "match_names",
    "non_tensor_note",
    "prefix_pair",
    "prefix_rules",
    "row_order",
]


# -------------------------------------------------------------------------------------------
# User choices: ignore patterns and key maps.
def is_ignored(patterns: Sequence[str] | None, *names: str | None) -> bool:
    """Whether any of the names matches any fnmatch pattern."""
    if not patterns:
        return False
    return any(n is not None and fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def apply_key_map(key_map: KeyMap | None, key: str, default: str | None) -> str | None:
    """The side-B key of a side-A name under a user key_map (None: not checked)."""
    if key_map is None:
        return default
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, default)


def _mapped_to_none(key_map: KeyMap | None, key: str) -> bool:
    # A default that is not None tells "no entry" (use the detected name) from "None".
    return key_map is not None and apply_key_map(key_map, key, "") is None


class PrefixRules:
    """Key map of prefix rules ``OLD=NEW``: a name starting with OLD gets NEW instead.

    The first rule whose OLD begins the name applies (in the order given); names no rule
    touches keep their default pairing. Optimizer names have the rule applied to the parameter
    inside (``optim.state.<fqn>.<name>``).
    """

    def __init__(self, rules: Iterable[tuple[str, str]]) -> None:
        self.rules = [(str(old), str(new)) for old, new in rules]
        for old, new in self.rules:
            if old == new:
                raise ValueError(f"key map rule {old!r}={new!r} changes nothing")

    def __call__(self, name: str) -> str | None:
        """`name` with the first matching rule applied (a key map is callable)."""
        return self.rename(name)

    def rename(self, name: str) -> str:
        """`name` with the first matching rule applied (or unchanged)."""
        for old, new in self.rules:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def __repr__(self) -> str:
        return "PrefixRules(" + ", ".join(f"{o!r}={n!r}" for o, n in self.rules) + ")"


def prefix_rules(
    rules: Mapping[str, str] | Iterable[str] | Iterable[tuple[str, str]],
) -> PrefixRules:
    """Prefix rules from ``{"OLD": "NEW"}``, ``["OLD=NEW", ...]`` or ``[("OLD", "NEW")]``.

    Raises:
        ValueError: A rule is not ``OLD=NEW``.
    """
    pairs: list[tuple[str, str]] = []
    items: Iterable[Any] = rules.items() if isinstance(rules, Mapping) else rules
    for r in items:
        if isinstance(r, str):
            if "=" not in r:
                raise ValueError(f"key map rule {r!r} is not OLD=NEW (e.g. 'model.=' or 'a.=b.')")
            old, _, new = r.partition("=")
            pairs.append((old, new))
        else:
            old, new = r
            pairs.append((old, new))
    return PrefixRules(pairs)


# -------------------------------------------------------------------------------------------
# The prefix two sides differ by.
def prefix_pair(a: Iterable[str], b: Iterable[str]) -> tuple[str, str]:
    """(strip, add): the one prefix change that turns the most names of `a` into names of `b`.

    For checkpoints that put every model name under one extra prefix that is not a container
    (a wrapper module saved flat: ``model.0.weight`` for a live ``0.weight``), and the reverse.
    ``("", "")`` when no change pairs more names than the names as they are. Costs O(|a| + |b|)
    dictionary lookups (names are indexed by their last two components).
    """
    # Names that are already a set or a dict's keys are not copied (a million names: ~60 MB
    # a copy), and the common case, every name of one side on the other, ends here.
    a_set = a if isinstance(a, (set, frozenset, dict)) else set(a)
    b_set = b if isinstance(b, (set, frozenset, dict)) else set(b)
    exact = sum(1 for x in a_set if x in b_set)
    if exact == len(a_set) or exact == len(b_set):
        return ("", "")
    by_tail: dict[str, list[str]] = {}
    for y in b_set:
        by_tail.setdefault(_tail(y), []).append(y)
    candidates: set[tuple[str, str]] = set()
    a_tails: dict[str, list[str]] = {}
    for x in a_set:
        a_tails.setdefault(_tail(x), []).append(x)
    for x in sorted(x for x in a_set if x not in b_set)[:64]:
        for y in by_tail.get(_tail(x), ()):
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


def _tail(name: str) -> str:
    return ".".join(name.rsplit(".", 2)[-2:])


def _renamer(pair: tuple[str, str]) -> Callable[[str], str]:
    strip, add = pair

    def rename(name: str) -> str:
        return add + (name[len(strip) :] if name.startswith(strip) else name)

    return rename


# -------------------------------------------------------------------------------------------
# The sides and the result.
@dataclass
class Side:
    """One side's tensors under canonical names, ready to pair.

    Attributes:
        model: Canonical FQN -> handle (a live tensor, or the checkpoint's CkptKey).
        state: (parameter FQN, state name) -> handle.
        order: Parameter FQNs in param_groups order (maps the other side's integer ids).
        tied: Tied duplicate FQN -> the first FQN of the same parameter.
        optional: Model names the other side need not hold -> why (non-persistent buffers).
        adapters: Names of the live PEFT adapters (put back into an adapter file's names).
        id_keyed: Its optimizer state is keyed by integer ids (compare: both sides files).
        keys: The CheckpointKeys when the side is a checkpoint.
    """

    model: dict[str, Any] = field(default_factory=dict)
    state: dict[tuple[str, str], Any] = field(default_factory=dict)
    order: list[str] | None = None
    tied: dict[str, str] = field(default_factory=dict)
    optional: dict[str, str] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()
    id_keyed: bool = False
    keys: CheckpointKeys | None = None


@dataclass
class Words:
    """How an entry point names its two sides in findings."""

    a: str  # "live", "actual"
    b: str  # "the checkpoint", "expected"
    a_only_kind: str  # kind of a finding for a name only side A has
    b_only_kind: str
    hint: str  # what to do about a name only one side has
    at_a: str = "live"  # after a value of side A: "(7, 6) live", "(7, 6) in actual"
    at_b: str = "in the checkpoint"
    checked: str = "on the checked side"  # side A in a value finding's hints
    reference: str = "in the reference"
    convert_hint: str = "convert= (a conversion) or key_map= (renames)"


LIVE = _LIVE = Words(
    "live",
    "the checkpoint",
    "missing",
    "unexpected",
    "pass key_map if the checkpoint names it differently, or ignore= to exclude it",
)
FILES = _FILES = Words(
    "actual",
    "expected",
    "unexpected",
    "missing",
    "--key-map OLD=NEW (key_map=) if they name it differently, --ignore (ignore=) to leave it out",
    at_a="in actual",
    at_b="in expected",
    checked="in actual",
    reference="in expected",
    convert_hint="--convert / convert= (a conversion) or --key-map / key_map= (renames)",
)


@dataclass(slots=True)  # slots: one per pair
class Pair:
    """One tensor of side A paired with its entry on side B."""

    name: str  # canonical name on side A (model FQN or optim.state.<fqn>.<name>)
    fqn: str  # the parameter's FQN (== name for model tensors)
    a: Any
    b: CkptKey
    is_state: bool = False


@dataclass
class _Result:
    pairs: list[Pair] = field(default_factory=list)
    rows: list[MappingRow] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Options:
    key_map: KeyMap | None
    ignore: Sequence[str] | None
    words: Words
    b_keys: CheckpointKeys
    b_all: CheckpointKeys  # every entry of side B, to look a key_map's target up by name
    pair_rows: bool = True  # whether the pairs' own rows are made (compare makes them later)
    _by_key: dict[str, CkptKey] | None = None
    _by_name: dict[str, CkptKey] | None = None

    def b_entry(self, key_or_name: str) -> CkptKey | None:
        """Side B's entry of that key, else of that canonical name.

        The maps are made when first used: only a user's key map looks entries up this way.
        """
        if self._by_key is None or self._by_name is None:
            self._by_key, self._by_name = self.b_keys.by_key(), self.b_all.by_name()
        return self._by_key.get(key_or_name) or self._by_name.get(key_or_name)


def _pair(a: Side, b: Side, opt: _Options) -> _Result:
    """Pairs side A's tensors with side B's entries (the algorithm in the module docstring)."""
    out = _Result()
    used: set[str] = set()
    w = opt.words
    rules = opt.key_map if isinstance(opt.key_map, PrefixRules) else None
    ruled = (lambda n: rules.rename(n)) if rules is not None else (lambda n: n)
    names = a.model if rules is None else {ruled(n) for n in a.model}
    auto = _model_renamer(names, b, out, explicit=rules is not None)

    def lookup(n: str) -> str:
        return auto(ruled(n))

    adapter = _adapter_renamer(a, b)
    ties: dict[str, list[str]] = {}
    for dup, first in a.tied.items():
        ties.setdefault(first, [first]).append(dup)
    group_of = {n: g for g in ties.values() for n in g}
    base_weights = 0
    for name in sorted(a.model):
        target = b.model.get(adapter(lookup(name)) if adapter else lookup(name))
        status, reason = "compared", ""
        if target is None and name in group_of:
            held = [n for n in group_of[name] if lookup(n) in b.model]
            if held:
                target, status = b.model[lookup(held[0])], "tied"
                reason = f"tied to {held[0]}, which {w.b} holds"
                out.notes.append(f"{name} is tied to {held[0]}: checked against {target.key}")
        if target is None and not _user_mapped(opt, name):
            if name in a.optional:
                out.rows.append(MappingRow(name, None, "ignored", a.optional[name]))
                continue
            if adapter is not None and adapter(name) == name:
                base_weights += 1
                out.rows.append(
                    MappingRow(name, None, "ignored", "base weight, not in an adapter file")
                )
                continue
        _add(out, opt, used, name, name, a.model[name], target, status, reason, False)
    if base_weights:
        out.notes.append(
            f"{w.b} is an adapter file: {base_weights} base-model weight(s) {w.a} are not in it "
            "and were not checked"
        )
    if a.state and b.state:
        for fqn, item in sorted(a.state):
            key = optim_key(fqn, item)
            row = b.state.get((lookup(fqn), item))
            _add(
                out, opt, used, key, fqn, a.state[(fqn, item)], row, "compared", "", True,
                f"optimizer state '{item}' of {fqn} is not in {w.b}",
            )  # fmt: skip
    elif a.state or b.state:
        lone, kind, holder, other = (
            (a, w.a_only_kind, w.a, w.b) if a.state else (b, w.b_only_kind, w.b, w.a)
        )
        _one_sided_state(lone, lone is a, opt, out, used, kind, holder, other)
    _leftovers(a, b, opt, out, used)
    paired = sum(1 for p in out.pairs if not p.is_state)
    if a.model and b.model and 2 * paired < min(len(a.model), len(b.model)):
        # Most names on neither side pair: a different naming, not a few missing tensors.
        out.notes.append(
            f"{paired} of {len(a.model)} names pair; the two sides use different naming: state "
            f"how one becomes the other with {w.convert_hint}"
        )
    out.rows.sort(key=row_order)
    return out


def row_order(row: MappingRow) -> tuple[str, bool]:
    """How mapping rows are sorted: by name, a side-A row before a side-B-only row of it."""
    return (row.a or row.b or "", row.a is None)


def _user_mapped(opt: _Options, name: str) -> bool:
    """Whether the user's key map (a dict or callable) says something about `name`."""
    if opt.key_map is None or isinstance(opt.key_map, PrefixRules):
        return False
    return apply_key_map(opt.key_map, name, "") != ""


def _model_renamer(
    a_names: Collection[str], b: Side, out: _Result, explicit: bool
) -> Callable[[str], str]:
    """The prefix change that pairs the most model names, named in a note when there is one."""
    pair = prefix_pair(a_names, b.model)
    if pair == ("", ""):
        return lambda n: n
    rule = f"{pair[0]}={pair[1]}"
    out.notes.append(
        f"model names differ by a prefix: {pair[0] or 'none'!r} on one side is "
        f"{pair[1] or 'none'!r} on the other; paired that way"
        + ("" if explicit else f" (--key-map '{rule}' / key_map=prefix_rules(['{rule}']) says it)")
    )
    return _renamer(pair)


def _adapter_renamer(a: Side, b: Side) -> Callable[[str], str] | None:
    """For a PEFT adapter file: the live name without the adapter's name, else None."""
    if not (b.keys is not None and b.keys.adapter and a.adapters):
        return None
    drop = [f".{n}." for n in a.adapters]

    def strip(name: str) -> str:
        for d in drop:
            if d in name:
                return name.replace(d, ".", 1)
        return name

    return strip


def _target(opt: _Options, key: str, default: CkptKey | None) -> tuple[CkptKey | None, str]:
    """The side-B entry of a side-A key: the user's key map's, else the default; a problem."""
    if opt.key_map is None or isinstance(opt.key_map, PrefixRules):
        return default, ""
    mapped = apply_key_map(opt.key_map, key, default.key if default else None)
    if mapped is None:
        return None, ""
    if default is not None and mapped == default.key:
        return default, ""
    hit = opt.b_entry(mapped)
    if hit is None:
        return None, f"key_map names {mapped!r}, which {opt.words.b} lacks"
    return hit, ""


def _add(
    out: _Result,
    opt: _Options,
    used: set[str],
    key: str,
    fqn: str,
    value: Any,
    default: CkptKey | None,
    status: str,
    reason: str,
    is_state: bool,
    missing_msg: str = "",
) -> None:
    w = opt.words
    target, problem = _target(opt, key, default)
    if is_ignored(opt.ignore, key, target.key if target else None):
        out.rows.append(
            MappingRow(key, target.key if target else None, "ignored", "excluded by the user")
        )
        if target is not None:
            used.add(target.key)
        return
    if target is None and not problem and _mapped_to_none(opt.key_map, key):
        out.rows.append(MappingRow(key, None, "ignored", "key_map maps it to None"))
        return
    if problem:
        out.findings.append(Finding(key, w.a_only_kind, problem))
        out.rows.append(MappingRow(key, None, w.a_only_kind, "key_map target not found"))
        return
    if target is None:
        out.findings.append(
            Finding(
                key,
                w.a_only_kind,
                missing_msg or f"in {w.a} but not in {w.b}; {w.hint}",
            )
        )
        out.rows.append(MappingRow(key, None, w.a_only_kind, f"not in {w.b}"))
        return
    used.add(target.key)
    out.pairs.append(Pair(key, fqn, value, target, is_state))
    if opt.pair_rows:
        out.rows.append(MappingRow(key, target.key, status, reason))


def _leftovers(a: Side, b: Side, opt: _Options, out: _Result, used: set[str]) -> None:
    """Side-B entries nothing paired: a finding or an ignored row each."""
    w = opt.words
    with_state = {fqn for fqn, _ in a.state}
    for (fqn, item), r in sorted(b.state.items(), key=lambda kv: kv[1].key):
        if r.key in used:
            continue
        used.add(r.key)
        name = optim_key(fqn, item)
        if is_ignored(opt.ignore, name, r.key):
            out.rows.append(MappingRow(None, r.key, "ignored", "excluded by the user"))
        elif a.keys is not None:
            out.findings.append(Finding(name, w.b_only_kind, f"in {w.b} but not in {w.a}"))
            out.rows.append(MappingRow(None, r.key, w.b_only_kind, f"not in {w.a}"))
        elif fqn not in a.model:
            msg = f"optimizer state in {w.b} for a parameter the model does not have"
            out.findings.append(Finding(name, w.b_only_kind, msg))
            out.rows.append(MappingRow(None, r.key, w.b_only_kind, "no such live parameter"))
        elif fqn not in with_state:
            msg = (
                f"{w.b} has optimizer state '{item}' for {fqn} but the optimizer holds none for "
                "it (not loaded?)"
            )
            out.findings.append(Finding(name, "missing", msg))
            out.rows.append(MappingRow(name, r.key, "missing", "not live"))
        else:
            msg = f"{w.b} has optimizer state '{item}' for {fqn}; the optimizer has not"
            out.findings.append(Finding(name, w.b_only_kind, msg))
            out.rows.append(MappingRow(None, r.key, w.b_only_kind, "state name not live"))
    for r in opt.b_keys.rows:
        if r.key in used or not r.entry.is_tensor or r.role == "state":
            continue
        if r.role == "other":
            out.rows.append(MappingRow(None, r.key, "ignored", "training state, not model/optim"))
        elif is_ignored(opt.ignore, r.name, r.key):
            out.rows.append(MappingRow(None, r.key, "ignored", "excluded by the user"))
        else:
            out.findings.append(Finding(r.name, w.b_only_kind, f"in {w.b} but not in {w.a}"))
            out.rows.append(MappingRow(None, r.key, w.b_only_kind, f"not in {w.a}"))


def _one_sided_state(
    side: Side,
    is_a: bool,
    opt: _Options,
    out: _Result,
    used: set[str],
    kind: str,
    holder: str,
    other: str,
) -> None:
    """Optimizer state only one side has at all: ONE finding, every tensor in the rows."""
    kept = 0
    params: set[str] = set()
    for (fqn, item), handle in sorted(side.state.items()):
        name = optim_key(fqn, item)
        key = handle.key if isinstance(handle, CkptKey) else None
        if key is not None:
            used.add(key)
        ignored = is_ignored(opt.ignore, name, key)
        status = "ignored" if ignored else kind
        why = "excluded by the user" if ignored else f"optimizer state {other} does not hold"
        out.rows.append(MappingRow(name if is_a else None, None if is_a else key, status, why))
        if not ignored:
            kept += 1
            params.add(fqn)
    if kept:
        out.findings.append(
            Finding(
                "optim.state",
                kind,
                f"{holder} holds optimizer state ({kept} tensors of {len(params)} parameters) "
                f"and {other} holds none (a model-only checkpoint?): --ignore 'optim.*' "
                "(ignore=['optim.*']) checks the models alone",
            )
        )


# -------------------------------------------------------------------------------------------
# Checkpoint against checkpoint (compare).
@dataclass
class PairMatch:
    """Two checkpoints' tensors paired by canonical name.

    Attributes:
        pairs: Every pair to compare (its name, actual's entry ``a``, expected's ``b``).
        rows: Every tensor of both sides, with its status.
        findings: Names only one side holds (and key_map targets that do not exist).
        notes: Prefixes, id mappings, lone optimizer state, training state.
    """

    pairs: list[Pair] = field(default_factory=list)
    rows: list[MappingRow] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def match_checkpoints(
    a: CheckpointKeys,
    b: CheckpointKeys,
    *,
    read_a: ReadObjects | None = None,
    read_b: ReadObjects | None = None,
    key_map: KeyMap | None = None,
    ignore: Sequence[str] | None = None,
    pair_rows: bool = True,
) -> PairMatch:
    """Pairs the tensors of two checkpoints (`a` actual, `b` expected): every tensor lands.

    Args:
        a: The actual checkpoint's keys.
        b: The expected checkpoint's keys.
        read_a: Reads `a`'s non-tensor entries (param_groups ``params``, to map integer ids).
        read_b: The same for `b`.
        key_map: Actual's name -> expected's key or name (None: not compared), or prefix rules.
        ignore: fnmatch patterns of names (or either side's keys) to exclude.
        pair_rows: Whether `rows` holds the pairs' rows too; without, the caller makes them
            (``MappingRow(pair.name, pair.b.key, "compared")``) when it needs them, and sorts
            with `row_order` (a million pairs: ~70 MB less while pairing).
    """
    notes: list[str] = []
    sa, sb = _file_side(a), _file_side(b)
    for (s_id, read_id, label), (s_other, read_other) in (
        ((sa, read_a, "actual"), (sb, read_b)),
        ((sb, read_b, "expected"), (sa, read_a)),
    ):
        if not s_id.id_keyed or s_other.id_keyed or not s_other.state:
            continue
        assert s_id.keys is not None and s_other.keys is not None
        order = _file_order(s_other.keys, read_other)
        idmap = resolve_ids(s_id.keys, read_id or _no_objects, order or [])
        if order is None or idmap.error:
            notes.append(
                f"{label}: optimizer state keyed by integer ids, which cannot be paired with the "
                f"other side's parameter names ({idmap.error or 'it has no param_groups order'})"
            )
            continue
        s_id.state = {(idmap.ids.get(i, i), n): r for (i, n), r in s_id.state.items()}
        notes.append(
            f"{label}: optimizer state keyed by integer ids, mapped to the other side's "
            "parameter names in param_groups order"
        )
    opt = _Options(key_map, ignore, _FILES, b, b, pair_rows)
    res = _pair(sa, sb, opt)
    for side, keys in (("actual", a), ("expected", b)):
        note = non_tensor_note(keys, side)
        if note:
            notes.append(note)
    return PairMatch(res.pairs, res.rows, res.findings, notes + res.notes)


def _no_objects(keys: list[str]) -> dict[str, Any]:
    raise KeyError(keys[0] if keys else "")


def _file_side(k: CheckpointKeys) -> Side:
    return Side(
        model=k.model,  # read only: not copied
        state={(r.fqn, r.item): r for r in k.state.values() if r.entry.is_tensor},
        id_keyed=k.id_keyed,
        keys=k,
    )


def _file_order(k: CheckpointKeys, read: ReadObjects | None) -> list[str] | None:
    """A checkpoint's parameter FQNs in param_groups order (None without params lists)."""
    if read is None:
        return None
    lists = group_params(k, read)
    if lists is None:
        return None
    canon = canonicalizer(n for n in (r.raw for r in k.model.values()))
    return [canon(p) for ps in lists for p in ps]


# -------------------------------------------------------------------------------------------
# The live model against a checkpoint (verify, load, save).
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
    read_objects: ReadObjects,
    key_map: KeyMap | None = None,
    ignore: Sequence[str] | None = None,
) -> LiveMatch:
    """Pairs every live tensor with a checkpoint entry.

    Everything else becomes a finding or a row with its reason. Deterministic: every rank
    computes the same from the same names.

    Args:
        live: The live state (canonical names).
        ckpt: The checkpoint's keys.
        read_objects: Reads non-tensor entries (param_groups ``params`` lists, to map the
            integer ids of a raw ``optimizer.state_dict()`` to FQNs).
        key_map: Live key -> checkpoint key or name overrides (None: not checked), or prefix
            rules (``prefix_rules``).
        ignore: fnmatch patterns of keys the user excludes.
    """
    m = LiveMatch()
    a = Side(
        model=dict(live.model),
        tied=dict(live.tied),
        optional={n: "a non-persistent buffer the checkpoint does not hold" for n in live.buffers},
        adapters=live.adapters,
    )
    for n, t in live.buffers.items():
        a.model.setdefault(n, t)
    b = _file_side(ckpt)
    if live.optim_state is not None:
        m.findings += [Finding(key, kind, message) for key, kind, message in live.problems]
        a.state = live.state_tensors()  # non-tensor state (rare): nothing to compare
        order = [fqn for g in live.param_groups or [] for fqn in g["params"]]
        a.order = order
        if ckpt.id_keyed and b.state:
            idmap = resolve_ids(ckpt, read_objects, order)
            if idmap.error:
                m.findings.append(Finding("optim.state", "error", idmap.error))
                b.state = {}
            else:
                b.state = {(idmap.ids.get(i, i), n): r for (i, n), r in b.state.items()}
                m.notes.append(
                    "the checkpoint's optimizer state is keyed by integer ids (a raw "
                    "optimizer.state_dict()): mapped to parameters in param_groups order"
                )
        if not a.state and b.state:
            # An optimizer without state is reported once (live.problems); its checkpoint
            # state is then named in the rows only.
            for r in b.state.values():
                m.rows.append(MappingRow(None, r.key, "ignored", "the optimizer holds no state"))
            b.state = {}
            used_state = {r.key for r in ckpt.state.values()}
        else:
            used_state = set()
    else:
        used_state = set()
        if ckpt.state:
            fqns = {r.fqn for r in ckpt.state.values()}
            m.notes.append(
                f"the checkpoint holds optimizer state for {len(fqns)} parameter(s); pass "
                "optimizer= to verify it too"
            )
            for r in ckpt.state.values():
                if r.entry.is_tensor:
                    used_state.add(r.key)
                    m.rows.append(MappingRow(None, r.key, "ignored", "no optimizer passed"))
        b.state = {}
    keys_b = ckpt
    if used_state:
        keys_b = CheckpointKeys(
            rows=[r for r in ckpt.rows if r.key not in used_state],
            model=ckpt.model,
            adapter=ckpt.adapter,
        )
    opt = _Options(key_map, ignore, _LIVE, keys_b, ckpt)
    b.keys = keys_b
    res = _pair(a, b, opt)
    for p in res.pairs:
        m.items.append(LiveItem(p.name, p.fqn, p.a, p.b.key, p.is_state))
    m.rows += res.rows
    m.findings += res.findings
    m.notes += res.notes
    if live.optim_state is not None and live.param_groups is not None:
        _match_groups(m, live, ckpt, read_objects)
    note = non_tensor_note(ckpt)
    if note:
        m.notes.append(note)
    m.keys_a = len(live.tensors()) + len(live.buffers)
    m.keys_b = len(ckpt.tensors())
    m.rows.sort(key=lambda r: r.a or r.b or "")
    return m


def match_names(
    names: Iterable[str],
    ckpt: CheckpointKeys,
    tied: Mapping[str, str] | None = None,
    *,
    order: Sequence[str] = (),
    read_objects: ReadObjects | None = None,
) -> tuple[dict[str, str], list[Finding]]:
    """Live names (model FQNs and ``optim.state.<fqn>.<name>``) -> the checkpoint's own keys.

    The same pairing as ``match_live``, for callers that hold names rather than a live state
    (the manifest of a checkpoint just written). `order` (the optimizer's parameters in
    param_groups order) and `read_objects` map a raw ``optimizer.state_dict()``'s integer ids.
    Returns the pairs and what did not pair.
    """
    a = Side(tied=dict(tied or {}))
    for n in names:
        if n.startswith(OPTIM_STATE):
            fqn, _, item = n[len(OPTIM_STATE) :].rpartition(".")
            a.state[(fqn, item)] = None
        else:
            a.model[n] = None
    b = _file_side(ckpt)
    if ckpt.id_keyed and b.state and order and read_objects is not None:
        idmap = resolve_ids(ckpt, read_objects, order)
        b.state = {(idmap.ids.get(i, i), n): r for (i, n), r in b.state.items()}
    opt = _Options(None, None, _LIVE, ckpt, ckpt)
    res = _pair(a, b, opt)
    return {p.name: p.b.key for p in res.pairs}, [
        f for f in res.findings if f.kind == "missing" or f.key == "optim.state"
    ]


def match_groups(
    live: LiveState, ckpt: CheckpointKeys, read: ReadObjects
) -> tuple[list[GroupPair], list[Finding]]:
    """This rank's live param groups paired with the checkpoint's (hyperparameters included)."""
    m = LiveMatch()
    if live.optim_state is not None and live.param_groups is not None:
        _match_groups(m, live, ckpt, read)
    return m.groups, m.findings


def _match_groups(m: LiveMatch, live: LiveState, ckpt: CheckpointKeys, read: ReadObjects) -> None:
    """Each live param group with the checkpoint group holding the same parameters."""
    assert live.param_groups is not None
    group_members: dict[str, list[str]] = {}
    if ckpt.groups and not ckpt.groups_by_fqn:
        lists = group_params(ckpt, read) or []
        ordered = sorted(
            (g for g, hp in ckpt.groups.items() if "params" in hp), key=lambda g: (len(g), g)
        )
        order = [fqn for g in live.param_groups for fqn in g["params"]]
        ids = {}
        if ckpt.id_keyed:
            idmap = resolve_ids(ckpt, read, order)
            ids = idmap.ids
        canon = canonicalizer(live.model)
        for g, ps in zip(ordered, lists):
            group_members[g] = [ids.get(p, canon(p)) for p in ps]
    for gi, group in enumerate(live.param_groups):
        # param_names (torch >= 2.6 named optimizers) restates params; DCP's flattened form
        # does not save it.
        hps = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if ckpt.groups_by_fqn:
            head = group["params"][0] if group["params"] else None
            m.groups.append(GroupPair(gi, hps, ckpt.groups.get(head) if head else None))
            continue
        params = set(group["params"])
        match = next((cg for cg, ps in group_members.items() if set(ps) == params), None)
        m.groups.append(GroupPair(gi, hps, ckpt.groups[match] if match is not None else None))
        if match is None and ckpt.groups:
            m.findings.append(
                Finding(
                    group_key(gi, "params"),
                    "missing",
                    "no param group in the checkpoint has the same parameters",
                )
            )
