"""A conversion stated as data: renames per key pattern, each with a list of tensor ops.

For converters that are not Python (a C++ exporter, a config file). A spec is JSON-able::

    {"rules": [
        {"from": "layers.{i}.attention.wq.weight",
         "to": "model.layers.{i}.self_attn.q_proj.weight",
         "ops": [{"op": "permute_heads", "heads": 32}]},
        {"from": "layers.{i}.attention.wqkv.weight",
         "to": ["model.layers.{i}.self_attn.q_proj.weight",
                "model.layers.{i}.self_attn.k_proj.weight",
                "model.layers.{i}.self_attn.v_proj.weight"],
         "ops": [{"op": "split", "dim": 0, "sizes": [4096, 1024, 1024]}]},
        {"from": ["layers.{i}.w1.weight", "layers.{i}.w3.weight"],
         "to": "layers.{i}.gate_up.weight",
         "ops": [{"op": "cat", "dim": 0}]},
        {"from": "layers.{i}.experts.{e*}.w1", "to": "layers.{i}.experts.w1",
         "ops": [{"op": "stack", "dim": 0}]},
        {"from": "freqs_cis", "drop": "a rotary cache, recomputed on load"}],
     "cast": "bfloat16",
     "others": "keep"}

Patterns: ``{name}`` matches one dot-free component and must match the same text in every
pattern of the rule; ``{name*}`` (in a ``from`` of a ``stack`` or ``cat`` rule) gathers every
key that matches, in the order of the component (numeric when it is a number); in a ``to`` of a
``split``/``chunk``/``unbind`` rule it numbers the outputs 0, 1, ... Each source key is taken by
the first rule that matches it; keys no rule takes keep their name (``"others": "keep"``, the
default) or are dropped on purpose (``"drop"``). ``cast`` casts every floating-point target.

Ops, applied in order (to every tensor of the list until a ``cat``/``stack`` makes one, after a
``split``/``chunk``/``unbind`` to each output): ``transpose`` (dim0, dim1), ``t``, ``permute``
(dims), ``reshape`` (shape), ``narrow`` (dim, start, length), ``permute_heads`` (heads,
inverse: the RoPE permutation within each head that torchtitan's and torchtune's HF adapters
apply: ``view(heads, hd/2, 2, ...).transpose(1, 2)``; inverse: from HF), ``cast`` (dtype),
``cat`` / ``stack`` (dim), ``split`` (dim, sizes), ``chunk`` (chunks, dim), ``unbind`` (dim).
An op with ``"at": i`` applies to the i-th tensor of the list only (k of a split k and v).
A spec is compiled by running these ops on the tracer, like any callable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fsdpcheck.convert.trace import ConversionError

_PLACEHOLDER = re.compile(r"\{(\w+)(\*?)\}")


class _Pattern:
    def __init__(self, text: str) -> None:
        self.text = text
        self.names: list[tuple[str, bool]] = []
        parts = []
        pos = 0
        for m in _PLACEHOLDER.finditer(text):
            parts.append(re.escape(text[pos : m.start()]))
            name, star = m.group(1), bool(m.group(2))
            if any(n == name for n, _ in self.names):
                parts.append(f"(?P={name})")
            else:
                parts.append(f"(?P<{name}>[^.]+)")
                self.names.append((name, star))
            pos = m.end()
        parts.append(re.escape(text[pos:]))
        self.regex = re.compile("".join(parts) + r"\Z")

    @property
    def gathers(self) -> str | None:
        return next((n for n, star in self.names if star), None)

    def fill(self, values: Mapping[str, str]) -> str:
        def one(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in values:
                raise ConversionError(f"spec: {{{name}}} in {self.text!r} is bound by no 'from'")
            return values[name]

        return _PLACEHOLDER.sub(one, self.text)


def _listed(v: Any, what: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, Sequence) and v and all(isinstance(x, str) for x in v):
        return list(v)
    raise ConversionError(f"spec: {what} must be a key pattern or a list of them, not {v!r}")


def _order(value: str) -> tuple[int, int | str]:
    return (0, int(value)) if value.isdigit() else (1, value)


def spec_function(
    spec: Mapping[str, Any],
) -> tuple[Callable[[dict[str, Any]], dict[str, Any]], dict[str, str]]:
    """The callable a spec states (to trace), and the sources it drops on purpose (patterns).

    Raises:
        ConversionError: The spec is malformed (named in the message).
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("rules", []), Sequence):
        raise ConversionError("spec: a dict with a list of 'rules'")
    unknown = set(spec) - {"rules", "cast", "others", "description"}
    if unknown:
        raise ConversionError(f"spec: unknown field(s) {sorted(unknown)}")
    others = spec.get("others", "keep")
    if others not in ("keep", "drop"):
        raise ConversionError(f"spec: 'others' is 'keep' or 'drop', not {others!r}")
    cast = spec.get("cast")
    cast_dtype = _dtype(cast) if cast is not None else None
    rules = []
    for i, r in enumerate(spec.get("rules", [])):
        if not isinstance(r, Mapping) or "from" not in r:
            raise ConversionError(f"spec: rule {i} needs a 'from'")
        extra = set(r) - {"from", "to", "ops", "drop"}
        if extra:
            raise ConversionError(f"spec: rule {i} has unknown field(s) {sorted(extra)}")
        if ("to" in r) == ("drop" in r):
            raise ConversionError(f"spec: rule {i} needs either 'to' or 'drop'")
        ops = r.get("ops", [])
        if not isinstance(ops, Sequence) or not all(
            isinstance(o, Mapping) and "op" in o for o in ops
        ):
            raise ConversionError(f"spec: rule {i}'s 'ops' must be a list of {{'op': ...}}")
        rules.append(
            (
                [_Pattern(p) for p in _listed(r["from"], f"rule {i}'s 'from'")],
                [_Pattern(p) for p in _listed(r["to"], f"rule {i}'s 'to'")] if "to" in r else None,
                list(ops),
                str(r["drop"]) if "drop" in r else None,
            )
        )

    dropped: dict[str, str] = {}

    def convert(sd: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        taken: set[str] = set()
        for froms, tos, ops, drop in rules:
            for binding, keys in _bindings(froms, [k for k in sd if k not in taken]):
                taken.update(keys)
                if drop is not None:
                    for k in keys:
                        dropped[k] = drop
                    continue
                assert tos is not None
                values: Any = (
                    [sd[k] for k in keys] if len(keys) > 1 or froms[0].gathers else sd[keys[0]]
                )
                for op in ops:
                    values = _apply(op, values)
                names = _names(tos, binding, values)
                outs = values if isinstance(values, list) else [values]
                if len(names) != len(outs):
                    raise ConversionError(
                        f"spec: rule {froms[0].text!r} makes {len(outs)} tensor(s) for "
                        f"{len(names)} name(s) in 'to'"
                    )
                out.update(zip(names, outs))
        for k, v in sd.items():
            if k in taken:
                continue
            if others == "keep":
                out[k] = v
            else:
                dropped[k] = "not named by the spec ('others': 'drop')"
        if cast_dtype is not None:
            out = {k: v.to(cast_dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out

    return convert, dropped


def _bindings(froms: list[_Pattern], keys: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """Each way the rule's 'from' patterns match `keys`: the placeholders' values, the keys."""
    first = froms[0]
    gather = first.gathers
    found: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for k in keys:
        m = first.regex.match(k)
        if m is None:
            continue
        b = {n: v for n, v in m.groupdict().items() if n != gather}
        found.setdefault(tuple(sorted(b.items())), b)
    out = []
    for b in found.values():
        if gather is not None:
            hits = []
            for k in keys:
                m = first.regex.match(k)
                if m is not None and all(m.group(n) == v for n, v in b.items()):
                    hits.append((_order(m.group(gather)), k))
            if hits:
                out.append((b, [k for _, k in sorted(hits)]))
            continue
        wanted = []
        for p in froms:
            name = p.fill(b)
            if name not in keys:
                break
            wanted.append(name)
        else:
            out.append((b, wanted))
    return out


def _names(tos: list[_Pattern], binding: Mapping[str, str], values: Any) -> list[str]:
    if len(tos) == 1 and tos[0].gathers and isinstance(values, list):
        n = tos[0].gathers
        assert n is not None
        return [tos[0].fill({**binding, n: str(i)}) for i in range(len(values))]
    return [t.fill(binding) for t in tos]


def _dtype(name: Any) -> torch.dtype:
    d = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ConversionError(f"spec: {name!r} is not a torch dtype")
    return d


def _int(op: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = op.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConversionError(f"spec: op {op.get('op')!r} needs an int {key!r}, got {v!r}")
    return v


def _ints(op: Mapping[str, Any], key: str) -> list[int]:
    v = op.get(key)
    if not isinstance(v, Sequence) or not all(isinstance(x, int) for x in v):
        raise ConversionError(f"spec: op {op.get('op')!r} needs a list of ints {key!r}, got {v!r}")
    return list(v)


def permute_heads(w: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """The RoPE permutation within heads of a q/k projection (rows ``heads * head_dim``).

    ``inverse=False`` is what torchtitan's and torchtune's Hugging Face adapters apply on the way
    to HF (``view(heads, hd/2, 2, ...).transpose(1, 2)``); ``inverse=True`` undoes it.
    """
    rows, rest = w.shape[0], tuple(w.shape[1:])
    if heads <= 0 or rows % (2 * heads):
        raise ConversionError(
            f"permute_heads: {rows} rows do not split into {heads} heads of pairs"
        )
    hd = rows // heads
    split = (heads, 2, hd // 2) if inverse else (heads, hd // 2, 2)
    return w.reshape(*split, *rest).transpose(1, 2).reshape(rows, *rest)


def _apply(op: Mapping[str, Any], values: Any) -> Any:
    name = op["op"]
    if "at" in op:  # one tensor of the list only (after a split: k of k and v)
        if not isinstance(values, list):
            raise ConversionError(f"spec: op {name!r} has 'at' but applies to one tensor")
        at = _int(op, "at")
        if not -len(values) <= at < len(values):
            raise ConversionError(f"spec: op {name!r} 'at' {at} of {len(values)} tensors")
        values = list(values)
        values[at] = _apply({k: v for k, v in op.items() if k != "at"}, values[at])
        return values
    if name in ("cat", "stack"):
        if not isinstance(values, list):
            values = [values]
        fn = torch.cat if name == "cat" else torch.stack
        return fn(values, dim=_int(op, "dim", 0))
    if isinstance(values, list):
        got = [_apply(op, v) for v in values]
        if name in ("split", "chunk", "unbind"):
            return [t for g in got for t in g]
        return got
    t = values
    if name == "transpose":
        return t.transpose(_int(op, "dim0", 0), _int(op, "dim1", 1))
    if name == "t":
        return t.t()
    if name == "permute":
        return t.permute(*_ints(op, "dims"))
    if name in ("reshape", "view"):
        return t.reshape(*_ints(op, "shape"))
    if name == "narrow":
        return t.narrow(_int(op, "dim", 0), _int(op, "start"), _int(op, "length"))
    if name == "permute_heads":
        return permute_heads(t, _int(op, "heads"), bool(op.get("inverse", False)))
    if name == "cast":
        return t.to(_dtype(op.get("dtype")))
    if name == "contiguous":
        return t.contiguous()
    if name == "split":
        return list(t.split(_ints(op, "sizes"), dim=_int(op, "dim", 0)))
    if name == "chunk":
        return list(t.chunk(_int(op, "chunks"), dim=_int(op, "dim", 0)))
    if name == "unbind":
        return list(t.unbind(_int(op, "dim", 0)))
    raise ConversionError(f"spec: unknown op {name!r}")


__all__ = ["permute_heads", "spec_function"]
