"""One conversion model for every entry point: what a converted checkpoint is made of.

A conversion maps the ACTUAL side's layout (for ``verify``: what the live model's
``state_dict()`` returns) to the EXPECTED side's (the file the user opens), the direction of
``key_map``. ``convert=`` accepts, in this order of preference:

(a) the converting library's own function ``F(state_dict) -> state_dict`` (torchtitan's
    ``StateDictAdapter(...).to_hf``, ``functools.partial(convert_weights.tune_to_hf, ...)``);
(b) an adapter object with ``to_hf`` / ``from_hf``: the direction whose output names match the
    other side's is used;
(c) a spec (``fsdpcheck.convert.spec``): renames per key pattern plus ops, JSON-able, for
    converters that are not Python; a path to its JSON file; or ``"module:attr"`` naming any
    of these;
(d) a compiled ``Conversion`` (what the others compile to; ``Conversion.to_spec`` is JSON);
(e) what a model declares (``declared.Declared``: its own state-dict hooks, its library's save
    layouts), compiled into the declared layout whose names the other side holds, and
    ``declared.Chain(first, second)``: two of these in a row.

Compiling runs ``F`` once on shape-only tracing tensors of the sources' global shapes
(``trace``), never on data: every target tensor becomes a few pieces (``pieces``), a box of it
read from a strided box of one source, with an optional cast.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.convert.conversion import Conversion, Target, compiled, composed
from fsdpcheck.convert.declared import Chain, Declared
from fsdpcheck.convert.pieces import Piece
from fsdpcheck.convert.spec import permute_heads, spec_function
from fsdpcheck.convert.trace import ConversionError, trace

Shape = tuple[int, ...]

# NOTE: [rotary caches] Checkpoints of several formats hold the RoPE frequencies their model
# recomputes (Meta's ``rope.freqs``, HF's ``rotary_emb.inv_freq``, torchtitan's ``freqs_cis``
# and ``rope.cache``), and converters leave them out on purpose (torchtune's ``meta_to_tune``,
# torchtitan's adapters). Left out whole, such a tensor is listed as dropped, not unexpected.
_ROTARY = re.compile(r"(^|\.)(rope\.freqs|freqs_cis|inv_freq|rope\.cache)$")

__all__ = [
    "Chain",
    "Conversion",
    "ConversionError",
    "Piece",
    "Target",
    "compile_conversion",
    "describe_conversion",
    "permute_heads",
    "resolve_declared",
]


def describe_conversion(convert: Any) -> str:
    """A conversion in words: the function's qualified name, the file, or the spec."""
    if isinstance(convert, Conversion):
        return convert.description
    if isinstance(convert, Chain):
        return f"{describe_conversion(convert.first)}, then {describe_conversion(convert.second)}"
    if isinstance(convert, Declared):
        return f"the layouts {convert.description} declares"
    if isinstance(convert, (str, os.PathLike)):
        return os.fspath(convert)
    if isinstance(convert, Mapping):
        return str(convert.get("description", "a conversion spec"))
    fn = getattr(convert, "func", convert)  # functools.partial
    description = getattr(fn, "description", None)
    if isinstance(description, str):
        return description
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)


def compile_conversion(
    convert: Any,
    sources: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    *,
    other_names: Collection[str] | None = None,
    purpose: Mapping[str, str] | None = None,
) -> Conversion:
    """Compiles any statement of a conversion for these sources (see the module docstring).

    Args:
        convert: A callable, an adapter, a spec (dict, JSON path or ``"module:attr"``) or a
            Conversion.
        sources: Source name -> (global shape, dtype): the tensors the conversion is given.
        other_names: The other side's names (to pick an adapter's direction).
        purpose: Source name -> why the conversion may leave it out (a tied duplicate, a
            buffer): such a source is listed as dropped, not as unexpected, when unused.

    Returns:
        The Conversion.

    Raises:
        ConversionError: The conversion is not a strided map, raised, or is stated wrongly.
    """
    srcs = _sources(sources)
    conv = _compile(convert, srcs, other_names)
    for name, why in (purpose or {}).items():
        if name in conv.sources:
            conv.dropped.setdefault(name, why)
    for name in conv.sources:
        if _ROTARY.search(name):
            conv.dropped.setdefault(name, "a rotary cache, recomputed from the config on load")
    used = {p.source for t in conv.targets.values() for p in t.pieces}
    conv.dropped = {k: v for k, v in conv.dropped.items() if k not in used}
    return conv


def resolve_declared(
    convert: Any,
    sources: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    other_names: Collection[str] | None = None,
) -> Any:
    """A model's declared layouts (``declared.Declared``) resolved into the one to use.

    The layout whose names `other_names` holds most of (ties, and no other side: the state
    dict's); None when that is the live layout itself (nothing to convert). Anything else
    ``convert=`` accepts is returned as it is.
    """
    if not isinstance(convert, Declared):
        return convert
    return _chosen(convert, _sources(sources), other_names)[0]


def _unchanged(sd: dict[str, Any]) -> dict[str, Any]:
    """No conversion: every tensor as it is."""
    return dict(sd)


def _sources(
    sources: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
) -> dict[str, tuple[Shape, torch.dtype]]:
    return {
        str(k): (tuple(int(s) for s in shape), _dtype(dt)) for k, (shape, dt) in sources.items()
    }


def _chosen(
    declared: Declared,
    srcs: dict[str, tuple[Shape, torch.dtype]],
    other: Collection[str] | None,
) -> tuple[Any, Conversion | None]:
    """The declared candidate whose names `other` holds most of, and its compilation."""
    cands = declared.candidates()
    if other is None:
        return cands[0][1], None
    best: tuple[int, Any, Conversion | None] | None = None
    failed: list[ConversionError] = []
    for _, cand in cands:
        try:
            conv = None if cand is None else _compile(cand, srcs, None)
        except ConversionError as exc:
            failed.append(exc)
            continue
        names = srcs if conv is None else conv.targets
        hits = sum(1 for n in names if n in other)
        if best is None or hits > best[0]:
            best = (hits, cand, conv)
    if best is None:
        raise failed[0]
    return best[1], best[2]


def _dtype(dt: torch.dtype | str) -> torch.dtype:
    if isinstance(dt, torch.dtype):
        return dt
    d = getattr(torch, str(dt).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ConversionError(f"{dt!r} is not a torch dtype")
    return d


def _compile(
    convert: Any, srcs: dict[str, tuple[Shape, torch.dtype]], other: Collection[str] | None
) -> Conversion:
    if isinstance(convert, Conversion):
        return _checked(convert, srcs)
    if isinstance(convert, (str, os.PathLike)):
        return _compile(_load(convert), srcs, other)
    if isinstance(convert, Declared):
        cand, conv = _chosen(convert, srcs, other)
        return conv if conv is not None else _compile(cand or _unchanged, srcs, other)
    if isinstance(convert, Chain):
        first = _compile(convert.first, srcs, None)
        middle = {t.name: (t.shape, _dtype(t.dtype)) for t in first.targets.values()}
        return composed(first, _compile(convert.second, middle, other))
    if isinstance(convert, Mapping):
        if "fsdpcheck_conversion" in convert:
            return _checked(Conversion.from_spec(convert), srcs)
        fn, dropped = spec_function(convert)
        conv = _traced(fn, srcs, str(convert.get("description", "the conversion spec")))
        conv.dropped.update(dropped)
        return conv
    to_hf, from_hf = getattr(convert, "to_hf", None), getattr(convert, "from_hf", None)
    if callable(to_hf) or callable(from_hf):
        return _adapter(convert, to_hf, from_hf, srcs, other)
    if callable(convert):
        return _traced(convert, srcs, describe_conversion(convert))
    raise ConversionError(
        f"convert= must be a function F(state_dict) -> state_dict, an adapter with to_hf / "
        f"from_hf, a spec (dict or JSON file), 'module:attr' or a Conversion, not "
        f"{type(convert).__name__}"
    )


def _traced(
    fn: Callable[..., Any], srcs: dict[str, tuple[Shape, torch.dtype]], what: str
) -> Conversion:
    targets, notes = trace(fn, srcs, what)
    conv = compiled(targets, srcs, what)
    conv.notes += notes
    return conv


def _adapter(
    adapter: Any,
    to_hf: Any,
    from_hf: Any,
    srcs: dict[str, tuple[Shape, torch.dtype]],
    other: Collection[str] | None,
) -> Conversion:
    """The adapter's direction whose output names the other side holds most of."""
    name = type(adapter).__qualname__
    tried: list[tuple[int, int, Conversion]] = []
    errors: list[ConversionError] = []
    for rank, (fn, label) in enumerate(((to_hf, "to_hf"), (from_hf, "from_hf"))):
        if not callable(fn):
            continue
        try:
            conv = _traced(fn, srcs, f"{name}.{label}")
        except ConversionError as exc:
            errors.append(exc)
            continue
        hits = sum(1 for t in conv.targets if other is not None and t in other)
        tried.append((hits, -rank, conv))
    if not tried:
        raise errors[0]
    return max(tried, key=lambda x: (x[0], x[1]))[2]


def _checked(conv: Conversion, srcs: dict[str, tuple[Shape, torch.dtype]]) -> Conversion:
    """A compiled conversion, held to the sources it is given now."""
    for name, (shape, _) in conv.sources.items():
        if name in srcs and srcs[name][0] != shape:
            raise ConversionError(
                f"{conv.description}: compiled for {name} of shape {shape}, but it is "
                f"{srcs[name][0]} here"
            )
    for t in conv.targets.values():
        for p in t.pieces:
            if p.source not in srcs:
                raise ConversionError(
                    f"{conv.description}: {t.name} reads {p.source}, which is not on this side"
                )
    out = Conversion(dict(conv.targets), dict(conv.sources), dict(conv.dropped), conv.description,
                     list(conv.notes))  # fmt: skip
    for name, (shape, dtype) in srcs.items():
        out.sources.setdefault(name, (shape, str(dtype).removeprefix("torch.")))
    return out


def _import(module: str) -> Any:
    """The module, looked up from the working directory too (a console script's path lacks it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        here = os.getcwd()
        if here in sys.path:
            raise
        sys.path.insert(0, here)
        try:
            return importlib.import_module(module)
        finally:
            sys.path.remove(here)


def _load(ref: str | os.PathLike[str]) -> Any:
    """A spec's JSON file, or the object ``module:attr`` names."""
    text = os.fspath(ref)
    path = Path(text)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConversionError(f"{text}: not a readable JSON conversion spec ({exc})") from None
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise ConversionError(
            f"convert: {text!r} is neither a spec file nor 'module:attr' (e.g. mypkg.conv:to_hf)"
        )
    try:
        obj: Any = _import(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConversionError(f"convert: cannot load {text!r}: {exc}") from None
    return obj
