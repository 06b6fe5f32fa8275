"""Matching live keys (model FQNs, optimizer state) with a checkpoint's keys."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fsdpcheck.sources.base import Entry

# Prefixes a checkpoint (or a live state dict) may put before model FQNs.
PREFIXES = ("", "model.", "module.", "_orig_mod.", "model.module.", "module.module.")
# Top-level containers of a nested checkpoint that hold the model's state dict.
MODEL_CONTAINERS = {"model", "module", "state_dict", "model_state_dict", "model_state", "models"}
OPTIM_CONTAINERS = {"optim", "optimizer", "optimizer_state_dict", "optim_state", "optimizers"}
_STATE_RE = re.compile(r"^(?:(?:optim|optimizer)\.)?state\.(.+)\.([^.]+)$")
_GROUP_RE = re.compile(r"^(?:(?:optim|optimizer)\.)?param_groups\.(\d+)\.(.+)$")

KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]


def optim_key(fqn: str, name: str) -> str:
    """The live key of an optimizer state entry."""
    return f"optim.state.{fqn}.{name}"


def group_key(index: int, name: str) -> str:
    """The live key of a param_groups hyperparameter."""
    return f"optim.param_groups.{index}.{name}"


@dataclass
class Classified:
    """The checkpoint's entries by role."""

    model: dict[str, Entry] = field(default_factory=dict)  # name (container stripped) -> entry
    state: dict[tuple[str, str], Entry] = field(default_factory=dict)  # (fqn, name) -> entry
    groups: dict[int, dict[str, Entry]] = field(default_factory=dict)  # group -> name -> entry


def classify(entries: Mapping[str, Entry]) -> Classified:
    """Sorts entries into model tensors, optimizer state and param_groups hyperparameters.

    Structural paths decide where they exist (DCP's planner data, nested torch.save dicts);
    flat keys fall back to the ``[optim.]state.<fqn>.<name>`` / ``param_groups.<i>.<name>``
    shapes. Non-tensor entries outside the optimizer (an "epoch" counter) are not model entries.
    """
    out = Classified()
    has_model_container = any(
        len(e.path) > 1 and e.path[0] in MODEL_CONTAINERS for e in entries.values()
    )
    for e in entries.values():
        role = _role(e.path)
        if role[0] == "state":
            out.state[(role[1], role[2])] = e
        elif role[0] == "group":
            out.groups.setdefault(int(role[1]), {})[role[2]] = e
        elif e.is_tensor:
            p = e.path
            if len(p) > 1 and p[0] in MODEL_CONTAINERS:
                out.model[".".join(p[1:])] = e
            elif not has_model_container and p[0] not in OPTIM_CONTAINERS:
                out.model[".".join(p)] = e
    return out


def _role(p: tuple[str, ...]) -> tuple[str, ...]:
    for i in (0, 1):
        if i == 1 and p[0] not in OPTIM_CONTAINERS:
            break
        if len(p) == i + 3 and p[i] == "state":
            return ("state", p[i + 1], p[i + 2])
        if len(p) == i + 3 and p[i] == "param_groups" and p[i + 1].isdigit():
            return ("group", p[i + 1], p[i + 2])
    if len(p) == 1:
        m = _STATE_RE.match(p[0])
        if m:
            return ("state", m.group(1), m.group(2))
        m = _GROUP_RE.match(p[0])
        if m:
            return ("group", m.group(1), m.group(2))
    return ("model",)


def best_prefix(live: Sequence[str], names: Sequence[str]) -> tuple[str, str]:
    """(add, strip): checkpoint name = add + live name with `strip` removed, matching the most."""
    names_set = set(names)
    best = ("", "")
    best_score = -1
    for strip in PREFIXES:
        for add in PREFIXES:
            score = sum(
                1 for k in live if k.startswith(strip) and add + k[len(strip) :] in names_set
            )
            if score > best_score:
                best, best_score = (add, strip), score
    return best


def map_with(prefix: tuple[str, str], key: str) -> str:
    """Applies a best_prefix result to one live name."""
    add, strip = prefix
    return add + (key[len(strip) :] if key.startswith(strip) else key)


def apply_key_map(key_map: KeyMap | None, key: str, default: str | None) -> str | None:
    """The checkpoint key of a live key under a user key_map (None: not checked)."""
    if key_map is None:
        return default
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, default)
