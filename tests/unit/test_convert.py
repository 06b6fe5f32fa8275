"""The conversion model: tracing F into pieces, the piece algebra, coverage, specs, adapters.

The reference for the pieces is F itself, run on index tensors: each source element holds its
own (source, linear index) code, so F's output names, for every target element, the source
element it is made of; the pieces must say the same.
"""

from __future__ import annotations

import functools
import itertools
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpcheck.convert import (
    Conversion,
    ConversionError,
    compile_conversion,
    permute_heads,
)
from fsdpcheck.convert.pieces import (
    Piece,
    cut,
    interval_boxes,
    ravel,
    source_box,
    split_for_reading,
    target_box,
    unravel,
    within,
)

CODE = 1 << 32  # a source element's code: source number * CODE + its linear index


def codes(sources: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Index tensors of the sources: every element holds its own code."""
    return {
        k: (torch.arange(math.prod(shape), dtype=torch.int64) + i * CODE).reshape(shape)
        for i, (k, (shape, _)) in enumerate(sources.items())
    }


def apply_pieces(conv: Conversion, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every target built from its pieces alone (the index tensors of the sources as data)."""
    out = {}
    for t in conv.targets.values():
        flat = torch.full((math.prod(t.shape),), -1, dtype=torch.int64)
        hits = torch.zeros_like(flat)
        for p in t.pieces:
            src = sources[p.source].flatten()
            vals = src.as_strided(p.size, p.strides, p.start)
            view = flat.view(p.view)
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.size))
            view[box] = vals
            hits.view(p.view)[box] += 1
        assert bool((hits == 1).all()), f"{t.name}: pieces do not tile it"
        out[t.name] = flat.view(t.shape)
    return out


def assert_pieces_match(fn, sources) -> Conversion:
    conv = compile_conversion(fn, sources)
    data = codes(sources)
    want = {k: v.contiguous() for k, v in fn(data).items()}
    got = apply_pieces(conv, data)
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    # Coverage: the elements no target holds are the ones F's outputs never name.
    used = torch.cat([v.flatten() for v in want.values()]) if want else torch.tensor([])
    for i, (k, (shape, _)) in enumerate(sources.items()):
        n = math.prod(shape)
        seen = torch.unique(used[(used >= i * CODE) & (used < i * CODE + n)])
        unused = conv.source_unused().get(k, (0, ""))[0]
        assert unused == n - len(seen), k
    assert conv.target_problems() == {}
    return conv


# -------------------------------------------------------------------------------------------
# Random compositions of view ops (hypothesis), replayed as F.
def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(2, n // a):
                if (n // a) % b == 0:
                    out.append((a, b, n // a // b))
    return out


@st.composite
def programs(draw, given_sources=None):
    """Source shapes (or `given_sources`) and a list of ops, each valid on the shapes it meets."""
    if given_sources is None:
        nsrc = draw(st.integers(1, 2))
        shapes = [
            tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))) for _ in range(nsrc)
        ]
        sources = {f"s{i}": (s, torch.float32) for i, s in enumerate(shapes)}
    else:
        sources = dict(given_sources)
    data = codes(sources)
    pool = list(data.values())
    names = list(data)
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(pool) - 1))
        x = pool[i]
        kind = draw(st.sampled_from(
            ["transpose", "reshape", "slice", "select", "split", "unsqueeze", "clone", "cat",
             "stack", "expand", "flatten", "permute"]
        ))  # fmt: skip
        if kind == "transpose" and x.dim() >= 2:
            a, b = draw(st.permutations(range(x.dim())))[:2]
            op = ("transpose", i, a, b)
        elif kind == "permute" and x.dim() >= 2:
            op = ("permute", i, tuple(draw(st.permutations(range(x.dim())))))
        elif kind == "reshape" and x.numel() > 0:
            op = ("reshape", i, draw(st.sampled_from(_factorizations(x.numel()))))
        elif kind == "slice" and x.dim() >= 1 and x.shape[0] >= 1:
            d = draw(st.integers(0, x.dim() - 1))
            n = x.shape[d]
            a = draw(st.integers(0, n - 1))
            b = draw(st.integers(a + 1, n))
            op = ("slice", i, d, a, b, draw(st.integers(1, 3)))
        elif kind == "select" and x.dim() >= 2:
            d = draw(st.integers(0, x.dim() - 1))
            op = ("select", i, d, draw(st.integers(0, x.shape[d] - 1)))
        elif kind == "split" and x.dim() >= 1 and x.shape[0] >= 2:
            op = ("split", i, draw(st.integers(1, x.shape[0] - 1)), draw(st.integers(0, 1)))
        elif kind == "unsqueeze":
            op = ("unsqueeze", i, draw(st.integers(0, x.dim())))
        elif kind == "clone":
            op = ("clone", i)
        elif kind == "flatten":
            op = ("flatten", i)
        elif kind == "expand" and x.dim() >= 1:
            op = ("expand", i, draw(st.integers(1, 3)))
        elif kind in ("cat", "stack") and x.dim() >= 1:
            j = draw(st.integers(0, len(pool) - 1))
            y = pool[j]
            if kind == "stack" and y.shape == x.shape:
                op = ("stack", i, j, draw(st.integers(0, x.dim())))
            elif kind == "cat" and y.dim() == x.dim():
                diff = [d for d in range(x.dim()) if x.shape[d] != y.shape[d]]
                if len(diff) > 1:
                    continue
                op = ("cat", i, j, diff[0] if diff else draw(st.integers(0, x.dim() - 1)))
            else:
                continue
        else:
            continue
        ops.append(op)
        pool.append(_run(op, pool))
    outs = draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=4, unique=True))
    return sources, names, ops, outs


def _run(op, pool):
    kind, i, *args = op
    x = pool[i]
    if kind == "transpose":
        return x.transpose(*args)
    if kind == "permute":
        return x.permute(*args[0])
    if kind == "reshape":
        return x.reshape(args[0])
    if kind == "slice":
        d, a, b, step = args
        return x[(slice(None),) * d + (slice(a, b, step),)]
    if kind == "select":
        return x.select(*args)
    if kind == "split":
        return x.split(args[0])[args[1] % len(x.split(args[0]))]
    if kind == "unsqueeze":
        return x.unsqueeze(args[0])
    if kind == "clone":
        return x.clone()
    if kind == "flatten":
        return x.flatten()
    if kind == "expand":
        return x.unsqueeze(0).expand(args[0], *x.shape)
    if kind == "cat":
        return torch.cat([x, pool[args[0]]], args[1])
    if kind == "stack":
        return torch.stack([x, pool[args[0]]], args[1])
    raise AssertionError(kind)


@given(programs())
def test_pieces_of_random_view_compositions_are_what_f_computes(program):
    sources, names, ops, outs = program

    def fn(sd):
        pool = [sd[n] for n in names]
        for op in ops:
            pool.append(_run(op, pool))
        return {f"out{k}": pool[k] for k in outs}

    conv = assert_pieces_match(fn, sources)
    for t in conv.targets.values():
        assert len(t.pieces) <= 64, (t.name, len(t.pieces))


# -------------------------------------------------------------------------------------------
# The conversions of the issue, by hand.
H, HD, D = 4, 8, 12


def test_rope_permutation_is_one_piece_and_its_inverse_undoes_it():
    sources = {"wq": ((H * HD, D), torch.float32)}
    conv = assert_pieces_match(lambda sd: {"q": permute_heads(sd["wq"], H)}, sources)
    assert len(conv.targets["q"].pieces) == 1
    both = assert_pieces_match(
        lambda sd: {"q": permute_heads(permute_heads(sd["wq"], H), H, inverse=True)}, sources
    )
    (p,) = both.targets["q"].pieces
    assert p.strides == (D, 1) or math.prod(p.view) == H * HD * D  # back to the identity
    data = codes(sources)
    assert torch.equal(apply_pieces(both, data)["q"], data["wq"])


def test_torchtitan_style_permute_matches_torchtitan_code():
    """torchtitan's Llama3 StateDictAdapter._permute, written as it is there."""

    def _permute(w, n_heads_arg):
        dim1 = w.shape[0]
        dim2 = w.shape[1]
        return (
            w.view(n_heads_arg, dim1 // n_heads_arg // 2, 2, dim2)
            .transpose(1, 2)
            .reshape(dim1, dim2)
        )

    sources = {"layers.0.attention.wq.weight": ((H * HD, D), torch.float32)}
    fn = lambda sd: {"q": _permute(sd["layers.0.attention.wq.weight"], H)}  # noqa: E731
    conv = assert_pieces_match(fn, sources)
    assert len(conv.targets["q"].pieces) == 1
    # The same map as the spec's permute_heads.
    spec = compile_conversion(
        lambda sd: {"q": permute_heads(sd["layers.0.attention.wq.weight"], H)}, sources
    )
    assert spec.targets["q"].pieces == conv.targets["q"].pieces


def test_fused_qkv_split_cat_and_gate_up_and_experts():
    sources = {
        "wqkv": ((3 * H * HD, D), torch.float32),
        "w1": ((10, D), torch.float32),
        "w3": ((10, D), torch.float32),
        "experts": ((3, 10, D), torch.float32),
    }

    def fn(sd):
        q, k, v = sd["wqkv"].split([H * HD, H * HD, H * HD])
        out = {"q": permute_heads(q, H), "k": k, "v": v}
        out["gate_up"] = torch.cat([sd["w1"], sd["w3"]], 0)
        for e, w in enumerate(sd["experts"].unbind(0)):
            out[f"experts.{e}"] = w.t()
        out["stacked"] = torch.stack([sd["w1"], sd["w3"]])
        out["interleaved"] = torch.cat(
            [q.view(2, -1, D), k.view(2, -1, D), v.view(2, -1, D)], dim=1
        ).reshape(-1, D)
        return out

    conv = assert_pieces_match(fn, sources)
    assert len(conv.targets["interleaved"].pieces) == 3


def test_a_cast_is_recorded_on_the_piece():
    sources = {"w": ((4, 6), torch.float32), "b": ((6,), torch.bfloat16)}
    conv = compile_conversion(
        lambda sd: {"w": sd["w"].to(torch.bfloat16), "wb": torch.cat([sd["w"][0], sd["b"]]),
                    "twice": sd["w"].bfloat16().float()},
        sources,
    )  # fmt: skip
    assert conv.targets["w"].dtype == "bfloat16"
    assert conv.targets["w"].pieces[0].cast == ("bfloat16",)
    casts = {p.source: p.cast for p in conv.targets["wb"].pieces}
    assert casts == {"w": (), "b": ("float32",)}  # cat promotes the bfloat16 part
    assert conv.targets["twice"].pieces[0].cast == ("bfloat16", "float32")


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda sd: {"x": sd["w"] * 2}, "aten.mul"),
        (lambda sd: {"x": sd["w"] + sd["w"]}, "aten.add"),
        (lambda sd: {"x": sd["w"][torch.tensor([1, 0])]}, "aten.index"),
        (lambda sd: {"x": sd["w"].flip(0)}, "aten.flip"),
        (lambda sd: {"x": sd["w"][:1] if sd["w"].sum() > 0 else sd["w"]}, "aten.sum"),
        (lambda sd: {"x": torch.tensor(sd["w"].numpy())}, "Tensor.numpy"),
        (lambda sd: {"x": sd["w"][0, 0].item()}, "Tensor.item"),
    ],
)
def test_what_is_not_a_strided_map_is_refused_naming_op_and_key(fn, op):
    with pytest.raises(ConversionError) as exc:
        compile_conversion(
            fn, {"layers.0.w": ((4, 6), torch.float32), "w": ((4, 6), torch.float32)}
        )
    msg = str(exc.value)
    assert op in msg and "w" in msg and "\n" not in msg


def test_a_conversion_that_raises_or_makes_constants_is_one_line():
    with pytest.raises(ConversionError, match="raised KeyError"):
        compile_conversion(lambda sd: {"x": sd["nope"]}, {"w": ((2,), torch.float32)})
    with pytest.raises(ConversionError, match="made itself"):
        compile_conversion(lambda sd: {"x": torch.zeros(2)}, {"w": ((2,), torch.float32)})


def test_coverage_names_what_no_target_reads_and_drops_on_purpose():
    sources = {"w": ((6, 4), torch.float32), "lm_head": ((6, 4), torch.float32),
               "freqs": ((3,), torch.float32)}  # fmt: skip
    conv = compile_conversion(
        lambda sd: {"top": sd["w"][:4]},
        sources,
        purpose={"lm_head": "tied to w"},
    )
    unused = conv.source_unused()
    assert unused["w"] == (8, "[4:6, 0:4]")
    assert unused["freqs"] == (3, "")
    assert "lm_head" not in unused and conv.dropped == {"lm_head": "tied to w"}


def test_a_compiled_spec_with_a_gap_or_overlap_says_so():
    sources = {"w": ((4, 3), torch.float32)}
    conv = compile_conversion(lambda sd: {"x": torch.cat([sd["w"][:2], sd["w"][2:]])}, sources)
    spec = conv.to_spec()
    spec["targets"][0]["pieces"][1]["offset"] = [3, 0]
    spec["targets"][0]["pieces"][1]["size"] = [1, 3]
    bad = Conversion.from_spec(json.loads(json.dumps(spec)))
    assert "gap at [2:3" in bad.target_problems()["x"]
    with pytest.raises(ConversionError, match="outside"):
        spec["targets"][0]["pieces"][1]["offset"] = [4, 0]
        Conversion.from_spec(spec)


def test_to_spec_round_trips_and_digest_is_stable():
    sources = {"wq": ((H * HD, D), torch.float32)}
    conv = compile_conversion(lambda sd: {"q": permute_heads(sd["wq"], H).bfloat16()}, sources)
    back = Conversion.from_spec(json.loads(json.dumps(conv.to_spec())))
    assert back.targets == conv.targets and back.digest() == conv.digest()
    again = compile_conversion(back, sources)
    assert again.digest() == conv.digest()
    other = compile_conversion(lambda sd: {"q": sd["wq"]}, sources)
    assert other.digest() != conv.digest()


def test_locate_names_the_source_element_of_a_target_element():
    sources = {"wq": ((H * HD, D), torch.float32)}
    conv = compile_conversion(lambda sd: {"q": permute_heads(sd["wq"], H)}, sources)
    data = codes(sources)
    q = permute_heads(data["wq"], H)
    for index in (0, 5, 21 * D + 5, H * HD * D - 1):
        src, at = conv.locate("q", index)
        assert src == "wq"
        assert ravel(at, (H * HD, D)) == int(q.flatten()[index])


# -------------------------------------------------------------------------------------------
# Specs and adapters: the same pieces as the callable.
def test_spec_states_the_same_conversion_as_the_callable(tmp_path):
    sources = {
        "layers.0.attention.wq.weight": ((H * HD, D), torch.float32),
        "layers.1.attention.wq.weight": ((H * HD, D), torch.float32),
        "layers.0.wqkv": ((3 * H * HD, D), torch.float32),
        "layers.0.w1": ((10, D), torch.float32),
        "layers.0.w3": ((10, D), torch.float32),
        "layers.0.experts.0.w": ((10, D), torch.float32),
        "layers.0.experts.1.w": ((10, D), torch.float32),
        "layers.0.experts.10.w": ((10, D), torch.float32),
        "freqs_cis": ((5,), torch.float32),
        "norm.weight": ((D,), torch.float32),
        "stacked": ((2, 3, D), torch.float32),
    }
    spec = {
        "rules": [
            {"from": "layers.{i}.attention.wq.weight", "to": "model.layers.{i}.q.weight",
             "ops": [{"op": "permute_heads", "heads": H}]},
            {"from": "layers.{i}.wqkv", "to": ["l.{i}.q", "l.{i}.k", "l.{i}.v"],
             "ops": [{"op": "split", "dim": 0, "sizes": [H * HD] * 3}]},
            {"from": ["layers.{i}.w1", "layers.{i}.w3"], "to": "l.{i}.gate_up",
             "ops": [{"op": "cat", "dim": 0}]},
            {"from": "layers.{i}.experts.{e*}.w", "to": "l.{i}.experts",
             "ops": [{"op": "t"}, {"op": "stack", "dim": 0}]},
            {"from": "stacked", "to": "unstacked.{e*}", "ops": [{"op": "unbind", "dim": 0}]},
            {"from": "freqs_cis", "drop": "a rotary cache"},
        ],
        "cast": "bfloat16",
    }  # fmt: skip

    def fn(sd):
        out = {}
        for i in (0, 1):
            out[f"model.layers.{i}.q.weight"] = permute_heads(
                sd[f"layers.{i}.attention.wq.weight"], H
            )
        q, k, v = sd["layers.0.wqkv"].split([H * HD] * 3)
        out.update({"l.0.q": q, "l.0.k": k, "l.0.v": v})
        out["l.0.gate_up"] = torch.cat([sd["layers.0.w1"], sd["layers.0.w3"]])
        out["l.0.experts"] = torch.stack([sd[f"layers.0.experts.{e}.w"].t() for e in (0, 1, 10)])
        out.update({f"unstacked.{e}": t for e, t in enumerate(sd["stacked"].unbind(0))})
        out["norm.weight"] = sd["norm.weight"]
        return {k: v.bfloat16() for k, v in out.items()}

    by_fn = compile_conversion(fn, sources)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    for stated in (spec, path, str(path)):
        by_spec = compile_conversion(stated, sources)
        assert set(by_spec.targets) == set(by_fn.targets)
        for name, t in by_fn.targets.items():
            assert by_spec.targets[name].pieces == t.pieces, name
            assert by_spec.targets[name].dtype == "bfloat16"
        assert by_spec.dropped == {"freqs_cis": "a rotary cache"}
        assert by_spec.source_unused() == {}


@pytest.mark.parametrize(
    "spec",
    [
        {"rules": [{"from": "a"}]},
        {"rules": [{"from": "a", "to": "b", "ops": [{"op": "frobnicate"}]}]},
        {"rules": [{"from": "a", "to": "{x}"}]},
        {"rules": [], "others": "maybe"},
        {"rules": [], "unknown": 1},
        {"rules": [{"from": "a", "to": "b", "ops": [{"op": "narrow", "dim": "0"}]}]},
    ],
)
def test_a_malformed_spec_is_one_line(spec):
    with pytest.raises(ConversionError) as exc:
        compile_conversion(spec, {"a": ((4,), torch.float32)})
    assert "\n" not in str(exc.value)


class _Adapter:
    """An adapter in the shape of torchtitan's BaseStateDictAdapter (to_hf / from_hf)."""

    def to_hf(self, sd):
        return {"model." + k: permute_heads(v, H) for k, v in sd.items()}

    def from_hf(self, sd):
        return {k.removeprefix("model."): permute_heads(v, H, inverse=True) for k, v in sd.items()}


def test_an_adapter_is_used_in_the_direction_the_other_side_names():
    sources = {"q": ((H * HD, D), torch.float32)}
    to = compile_conversion(_Adapter(), sources, other_names={"model.q"})
    assert list(to.targets) == ["model.q"] and to.description.endswith("to_hf")
    back = compile_conversion(_Adapter(), {"model.q": ((H * HD, D), torch.float32)},
                              other_names={"q"})  # fmt: skip
    assert list(back.targets) == ["q"] and back.description.endswith("from_hf")
    part = functools.partial(lambda sd, n: {"x": permute_heads(sd["q"], n)}, n=H)
    assert compile_conversion(part, sources).targets["x"].pieces == to.targets["model.q"].pieces


ADAPTER = _Adapter()


def test_module_attr_names_a_conversion():
    with pytest.raises(ConversionError, match="cannot load"):
        compile_conversion("fsdpcheck.nope:x", {"q": ((8,), torch.float32)})
    with pytest.raises(ConversionError, match="neither a spec file"):
        compile_conversion("no-such-file.json", {"q": ((8,), torch.float32)})
    conv = compile_conversion(
        "tests.unit.test_convert:ADAPTER", {"q": ((H * HD, D), torch.float32)}
    )
    assert list(conv.targets) == ["model.q"]


# -------------------------------------------------------------------------------------------
# The algebra against brute force.
@given(
    st.integers(0, 20),
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=3),
    st.integers(0, 60),
    st.integers(0, 60),
)
def test_interval_boxes_against_brute_force(base, raw, lo, width):
    # Nested digits: each multiplier greater than the span of the ones inside it.
    digits = []
    span = 0
    for count, gap in sorted(raw, key=lambda x: x[1]):
        m = span + gap
        digits.append((count, m))
        span += (count - 1) * m
    digits.reverse()
    hi = lo + width
    want = {
        idx
        for idx in itertools.product(*(range(c) for c, _ in digits))
        if lo <= base + sum(i * m for i, (_, m) in zip(idx, digits)) < hi
    }
    got = set()
    boxes = interval_boxes(base, digits, lo, hi)
    assert len(boxes) <= 2 * len(digits) + 1
    for box in boxes:
        cells = set(itertools.product(*(range(s, s + n) for s, n in box)))
        assert not cells & got
        got |= cells
    assert got == want


@given(st.data())
def test_within_source_box_and_target_box_against_brute_force(data):
    sources = {"w": ((H * HD, 6), torch.float32)}
    fn = data.draw(st.sampled_from([
        lambda sd: {"x": permute_heads(sd["w"], H)},
        lambda sd: {"x": sd["w"].t()},
        lambda sd: {"x": sd["w"][1::3]},
        lambda sd: {"x": sd["w"].reshape(4, 8, 6).transpose(0, 1).reshape(32, 6)},
    ]))  # fmt: skip
    conv = compile_conversion(fn, sources)
    shape = sources["w"][0]
    t = conv.targets["x"]
    lo = [data.draw(st.integers(0, s - 1)) for s in shape]
    size = [data.draw(st.integers(1, s - a)) for a, s in zip(lo, shape)]
    for p in t.pieces:
        first, span = source_box(p, shape)
        elems = {(idx, p.source_index(idx)) for idx in _cells(p)}
        assert all(
            all(f <= c < f + s for c, f, s in zip(unravel(i, shape), first, span)) for _, i in elems
        )
        want = {
            idx
            for idx, i in elems
            if all(a <= c < a + n for c, a, n in zip(unravel(i, shape), lo, size))
        }
        got = [c for q in within(p, shape, lo, size) for c in _cells(q)]
        assert len(got) == len(set(got)) and set(got) == want
        for q in split_for_reading(p, t.shape) + cut(p, 7):
            off, sz, _moves = target_box(q, t.shape)
            for idx in _cells(q):
                at = unravel(ravel(idx, q.view), t.shape)
                assert all(o <= c < o + s for c, o, s in zip(at, off, sz))
        parts = split_for_reading(p, t.shape)
        assert sum(q.numel for q in parts) == p.numel
        for q in parts:
            _, sz, _ = target_box(q, t.shape)
            assert math.prod(sz) <= 2 * q.numel or q.numel == 1


def _cells(p: Piece):
    return list(itertools.product(*(range(o, o + n) for o, n in zip(p.offset, p.size))))


def test_a_run_across_rows_of_the_source_is_split_where_it_wraps():
    # Rows of the target start mid-row of the source: not one box of the source.
    sources = {"w": ((5, 6), torch.float32)}
    conv = assert_pieces_match(lambda sd: {"x": sd["w"].flatten()[3:27].view(4, 6)}, sources)
    assert 1 < len(conv.targets["x"].pieces) <= 16
    assert conv.source_unused()["w"][0] == 6  # [0:1, 0:3] and [4:5, 3:6]
