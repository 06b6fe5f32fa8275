"""The naming vocabulary every side shares: canonical model FQNs and optimizer entry names.

- model tensors by their canonical FQN: the name the unwrapped model gives them. Wrapper
  components (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod``) are
  removed wherever they appear; leading wrapper prefixes (``module.`` of DDP/DeepSpeed,
  ``_forward_module.`` of Lightning, ``_orig_mod.`` of torch.compile) are removed while every
  model name of that side carries them. A prefix that is part of the model's own FQNs (``model.``
  of a Hugging Face ``*ForCausalLM``) is never removed here: a difference of prefix between two
  sides is found, and named, by the pairing (``pairing.prefix_pair``).
- optimizer state as ``optim.state.<fqn>.<name>``, hyperparameters as
  ``optim.param_groups.<i>.<name>``.

Both the live side (``live``) and the checkpoint side (``keys``) import this module and nothing
else of each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Components that wrappers insert anywhere in a name; never part of a real model's FQNs.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Leading components that wrappers put before every name (DDP/DeepSpeed, Lightning, compile).
WRAPPER_PREFIXES = ("module", "_forward_module", "_orig_mod")

OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."


def optim_key(fqn: str, name: str) -> str:
    """The canonical name of an optimizer state entry."""
    return f"{OPTIM_STATE}{fqn}.{name}"


def group_key(index: int | str, name: str) -> str:
    """The canonical name of a param_groups hyperparameter."""
    return f"{OPTIM_GROUPS}{index}.{name}"


def is_optim_name(name: str) -> bool:
    """Whether a canonical name is optimizer state or a hyperparameter."""
    return name.startswith(("optim.state.", "optim.param_groups.")) or name == "optim.state"


def canonical_names(
    names: Iterable[str], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> dict[str, str]:
    """Original name -> canonical FQN, for the model names of ONE side.

    Interior wrapper components go; a leading wrapper prefix goes only while every name has it
    (so a model whose own top-level module happens to be called ``module`` on both sides still
    matches, and ``model.`` is never touched).

    Args:
        names: Every model name of the side.
        prefixes: The leading wrapper components this side's writer may add.
    """
    # NOTE: [lean canonical names] A million names split into lists of components took ~600
    # bytes per name at once, and every unchanged name was rebuilt as a new string. Only the
    # names that hold a wrapper component are split; the others keep their own string object,
    # and the leading prefix is found from each name's first component.
    names = list(names)
    parts: dict[str, list[str]] = {}
    for n in names:
        if any(w in n for w in WRAPPER_COMPONENTS):
            got = [c for c in n.split(".") if c not in WRAPPER_COMPONENTS]
            if len(got) != n.count(".") + 1:
                parts[n] = got
    strip = 0
    while names:
        heads = set()
        for n in names:
            p = parts.get(n)
            if p is not None:
                heads.add(p[strip] if len(p) > strip + 1 else None)
            else:
                comps = n.split(".", strip + 1)
                heads.add(comps[strip] if len(comps) > strip + 1 else None)
            if len(heads) > 1:
                break
        if len(heads) != 1:
            break
        (head,) = heads
        if head not in prefixes:
            break
        strip += 1
    if not strip and not parts:
        return {n: n for n in names}
    out = {}
    for n in names:
        p = parts.get(n)
        if p is None:
            out[n] = n.split(".", strip)[strip] if strip else n
        else:
            out[n] = ".".join(p[strip:])
    return out


def canonicalizer(
    model_names: Iterable[str], prefixes: tuple[str, ...] = WRAPPER_PREFIXES
) -> Callable[[str], str]:
    """A function that canonicalises any name of the side whose model names are given.

    Optimizer FQNs are a subset of the model's names: they get the same treatment, decided by
    the model names (so Lightning's ``_forward_module.`` goes from model AND optimizer keys).
    """
    names = list(model_names)
    mapping = canonical_names(names, prefixes)
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


__all__ = [
    "WRAPPER_COMPONENTS",
    "WRAPPER_PREFIXES",
    "canonical_names",
    "canonicalizer",
    "group_key",
    "is_optim_name",
    "optim_key",
]
