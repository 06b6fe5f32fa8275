"""Conversions that models declare themselves: their own state-dict hooks and save mappings.

A model may keep a layout live that differs from what it saves, and say how in its own code:

- state-dict hooks of its modules (torchtitan 0.3.0's ``FusedQKVLinear`` keeps one ``wqkv``
  parameter, q/k/v interleaved per kv group, and its post-hook splits it into ``wq`` /
  ``wk`` / ``wv`` in ``state_dict()``): what ``state_dict()`` returns is the hooks' output;
- a save mapping of its library (a transformers 5 MoE model such as Mixtral holds its experts
  stacked, ``mlp.experts.gate_up_proj [E, 2I, H]``, and ``save_pretrained`` reverts the
  model's conversion mapping into one key per expert);
- a converter its library pairs with the model class (torchtitan's model packages hold a
  ``StateDictAdapter`` whose ``to_hf`` writes the Hugging Face export).

``declared_conversion(model)`` collects these into a ``Declared``, which ``convert=`` accepts:
it is compiled into the layout (the state dict's, or one of the saved ones) whose names the
other side holds. The hooks are traced on meta copies of the modules that register them
(``NOTE: [hooks on meta copies]``), never by calling ``state_dict()`` on the live model, which
runs them on the shards (torchtitan's hook gathers every ``wqkv`` to Replicate first).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck.live import hooked_modules, is_torch_hook, model_canonicalizer

Shape = tuple[int, ...]

__all__ = [
    "Chain",
    "Declared",
    "declared_conversion",
    "stated_or_declared",
]


@dataclass(frozen=True)
class Chain:
    """Two conversions in a row: `first` from the sources, then `second` from its result.

    Either is anything ``convert=`` accepts. Compiled as one conversion of `first`'s sources.
    """

    first: Any
    second: Any


@dataclass
class Declared:
    """The layouts a model declares: its state dict's, and those its library saves from it.

    Attributes:
        description: The model, in words (its class).
        hooks: Live layout -> ``state_dict()`` layout (the modules' own state-dict hooks, on
            meta copies), or None when ``state_dict()`` is the live layout.
        saved: (description, function from the ``state_dict()`` layout) of each other layout
            the model's library writes: ``save_pretrained``'s, an HF export's.
    """

    description: str
    hooks: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    saved: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = field(
        default_factory=list
    )

    def candidates(self) -> list[tuple[str, Any]]:
        """Each layout as (words, what ``convert=`` accepts; None: no conversion at all)."""
        out: list[tuple[str, Any]] = [(f"{self.description}'s state dict", self.hooks)]
        for words, fn in self.saved:
            named = _Named(fn, words)
            out.append((words, named if self.hooks is None else Chain(self.hooks, named)))
        return out


class _Named:
    """A conversion function with its description (``describe_conversion`` reads it)."""

    def __init__(self, fn: Callable[[dict[str, Any]], dict[str, Any]], description: str):
        self.fn = fn
        self.description = description

    def __call__(self, sd: dict[str, Any]) -> dict[str, Any]:
        return self.fn(sd)


# -------------------------------------------------------------------------------------------
def declared_conversion(model: Any) -> Declared | None:
    """The layouts `model` declares besides its live one, or None when it declares none.

    Args:
        model: An nn.Module (FSDP2 and wrappers included) or a list of model parts (pipeline
            stages, named as in the whole model); a state dict declares nothing.

    Returns:
        A Declared (``convert=`` accepts it), or None.
    """
    if isinstance(model, torch.nn.Module):
        parts = [model]
    elif (
        isinstance(model, (list, tuple))
        and model
        and all(isinstance(m, torch.nn.Module) for m in model)
    ):
        parts = list(model)  # the pipeline stages a rank runs, named as in the whole model
    else:
        return None
    hooked = [(part, prefix, m) for part in parts for prefix, m in hooked_modules(part)]
    hooks = _HookedStateDict(parts[0], hooked) if hooked else None
    first = parts[0]
    saved = [s for s in (_transformers_saved(first), _torchtitan_saved(first)) if s is not None]
    if hooks is None and not saved:
        return None
    return Declared(_class_name(first), hooks, saved)


def stated_or_declared(model: Any, convert: Any) -> Any:
    """What to convert the live model by: `convert`, after the model's own hooks if it has any.

    A stated conversion maps what ``state_dict()`` returns (after the model's own hooks); the
    live side is read as it is held, so the hooks come first. With nothing stated, the
    model's declared layouts.
    """
    declared = declared_conversion(model)
    if convert is None or declared is None or declared.hooks is None:
        return declared if convert is None else convert
    return Chain(declared.hooks, convert)


def _class_name(model: torch.nn.Module) -> str:
    return _plain_class(type(model)).__name__


def _plain_class(cls: type) -> type:
    """The module's own class under FSDP2's (``fully_shard`` makes ``FSDP<cls>``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule):
        for base in cls.__bases__:
            if base is not FSDPModule:
                return _plain_class(base)
    return cls


def _meta_copy(
    module: torch.nn.Module, path: str, slots: dict[str, tuple[dict[str, Any], str]]
) -> torch.nn.Module:
    """A copy of `module` that holds no data: its attributes, own hooks and submodules.

    NOTE: [hooks on meta copies] The copy shares the module's plain attributes (head counts,
    dims: what hooks read) and has its own parameter and buffer slots (`slots`: full path ->
    the dict and name to put a tensor in), filled with shape-only tracing tensors before its
    ``state_dict()`` runs. torch's own hooks (FSDP2's pre-hook, which would reshard the live
    module) are not copied, and FSDP2's class is replaced by the module's own.
    """
    cls: Any = _plain_class(type(module))
    copy = cls.__new__(cls)
    copy.__dict__.update(module.__dict__)
    params: dict[str, Any] = OrderedDict()
    for name, p in module._parameters.items():
        params[name] = None if p is None else _shape_only(p)
        if p is not None:
            slots[path + name] = (params, name)
    buffers: dict[str, Any] = OrderedDict()
    for name, b in module._buffers.items():
        buffers[name] = None if b is None else _shape_only(b)
        if b is not None:
            slots[path + name] = (buffers, name)
    children: dict[str, Any] = OrderedDict()
    for name, child in module._modules.items():
        children[name] = None if child is None else _meta_copy(child, path + name + ".", slots)
    pre = OrderedDict(
        (k, h) for k, h in module._state_dict_pre_hooks.items() if not is_torch_hook(h)
    )
    post = OrderedDict((k, h) for k, h in module._state_dict_hooks.items() if not is_torch_hook(h))
    object.__setattr__(copy, "_parameters", params)
    object.__setattr__(copy, "_buffers", buffers)
    object.__setattr__(copy, "_modules", children)
    object.__setattr__(copy, "_state_dict_pre_hooks", pre)
    object.__setattr__(copy, "_state_dict_hooks", post)
    return copy


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


class _HookedStateDict:
    """Live layout -> ``state_dict()`` layout: the model's hooks run on meta copies.

    Called on a state dict of the live layout's canonical names (the tracer's shape-only
    tensors): each hooked module's copy is filled with its tensors and its ``state_dict()``
    runs there; every other tensor keeps its name. Nothing of the live model is touched.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        hooked: list[tuple[torch.nn.Module, str, torch.nn.Module]],
    ) -> None:
        self.description = f"{_class_name(model)}'s state-dict hooks"
        self.parts: list[tuple[str, torch.nn.Module, dict[str, Any], Callable[[str], str]]] = []
        canons: dict[int, Callable[[str], str]] = {}
        for part, prefix, module in hooked:  # part: the model (or pipeline stage) it is in
            canon = canons.setdefault(id(part), model_canonicalizer(part))
            slots: dict[str, tuple[dict[str, Any], str]] = {}
            copy = _meta_copy(module, prefix, slots)
            self.parts.append((prefix, copy, {canon(k): v for k, v in slots.items()}, canon))

    def __call__(self, sd: Mapping[str, Any]) -> dict[str, Any]:
        owner: dict[str, int] = {}
        for i, (_, _, slots, _) in enumerate(self.parts):
            for name in slots:
                owner.setdefault(name, i)
        made: dict[int, dict[str, Any]] = {}
        out: dict[str, Any] = {}
        for key, value in sd.items():
            part = owner.get(key)
            if part is None:
                out[key] = value
            elif part not in made:  # the part's entries where its first tensor was
                made[part] = self._state_dict(part, sd)
                out.update(made[part])
        return out

    def _state_dict(self, i: int, sd: Mapping[str, Any]) -> dict[str, Any]:
        prefix, copy, slots, canon = self.parts[i]
        for name, (where, attr) in slots.items():
            if name in sd:
                where[attr] = sd[name]
        try:
            got = copy.state_dict(prefix=prefix, keep_vars=True)
        finally:
            for name, (where, attr) in slots.items():  # hold no traced tensor afterwards
                if name in sd:
                    where[attr] = _shape_only(where[attr])
        return {canon(k): v for k, v in got.items()}


# -------------------------------------------------------------------------------------------
# Libraries' save mappings.
def _mro_module(model: torch.nn.Module, package: str) -> type | None:
    """The first class of `model`'s whose module is under `package`."""
    for cls in type(model).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == package or module.startswith(package + "."):
            return cls
    return None


def _transformers_saved(model: torch.nn.Module) -> tuple[str, Callable] | None:
    """``save_pretrained``'s layout when the model's conversion mapping changes it.

    ``save_pretrained`` drops tied duplicates, then reverts the conversion mapping the model
    was loaded with (or its class's default one): the same two functions of transformers run
    here, on the tracer's shape-only tensors.
    """
    if _mro_module(model, "transformers") is None or not hasattr(model, "config"):
        return None
    hf: Any = model
    try:
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping

            conversions = get_model_conversion_mapping(hf, add_legacy=False)
        except Exception:  # a model transformers cannot map: it declares nothing
            return None
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    if not conversions:
        return None

    tied = _tied_duplicates(hf)

    def save_pretrained_layout(sd: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in sd.items() if k not in tied}
        return dict(revert_weight_conversion(hf, kept))

    words = f"{_class_name(model)}.save_pretrained's layout (its conversion mapping reverted)"
    return words, save_pretrained_layout


def _tied_duplicates(hf: Any) -> set[str]:
    """The tied parameters' names ``save_pretrained`` leaves out (it keeps one per group).

    NOTE: [tied names] transformers' ``remove_tied_weights_from_state_dict`` groups names by
    storage pointer, which shape-only tensors do not have; the groups are the same Parameter
    objects, and of each group it deletes the names its ``_tied_weights_keys`` patterns match,
    keeping at least one. The same rule, by object identity.
    """
    import re

    try:
        from transformers.modeling_utils import _get_tied_weight_keys

        patterns = list(_get_tied_weight_keys(hf))
    except (ImportError, AttributeError):
        patterns = []
    canon = model_canonicalizer(hf)
    by_id: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(canon(name))
    out: set[str] = set()
    for names in by_id.values():
        if len(names) < 2:
            continue
        drop = [n for n in sorted(names) if any(re.search(pat, n) for pat in patterns)]
        drop = drop[: len(names) - 1]  # at least the last sorted one stays
        out.update(drop or names[1:])  # no pattern (save_pretrained refuses): keep the first
    return out


def _torchtitan_saved(model: torch.nn.Module) -> tuple[str, Callable] | None:
    """The Hugging Face layout of a torchtitan model: its package's ``StateDictAdapter``.

    torchtitan pairs each model package (``torchtitan.models.llama3``) with one adapter
    class; built from the model's own config, its ``to_hf`` is what torchtitan's
    ``CheckpointManager`` writes with ``last_save_in_hf``.
    """
    cls = _mro_module(model, "torchtitan.models")
    config = getattr(model, "config", None)
    if cls is None or config is None:
        return None
    package = cls.__module__.rsplit(".", 1)[0]
    try:
        from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

        pkg = importlib.import_module(package)
    except ImportError:
        return None
    adapters = {
        a
        for a in vars(pkg).values()
        if isinstance(a, type)
        and issubclass(a, BaseStateDictAdapter)
        and a.__module__.startswith(package + ".")
    }
    if len(adapters) != 1:
        return None
    (adapter_cls,) = adapters
    try:
        adapter = adapter_cls(config, None)
    except Exception:  # an adapter that needs more than the config: not declared
        return None
    return f"torchtitan's HF export ({adapter_cls.__name__}.to_hf)", adapter.to_hf
