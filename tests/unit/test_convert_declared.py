"""Two conversions in a row, and the conversions models declare (their own state-dict hooks).

The reference for a composition is the two functions run one after the other on index tensors
(tests/unit/test_convert.py's codes): the composed pieces must name the same source element for
every target element. A model's hooks are checked against its own ``state_dict()`` on an unsharded
copy, and they must never run on the live model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import fsdpcheck
from fsdpcheck.convert import Chain, ConversionError, compile_conversion
from fsdpcheck.convert.declared import declared_conversion
from fsdpcheck.live import has_own_hooks, live_layout
from fsdpcheck.testing import unchanged
from tests.unit.test_convert import _run, apply_pieces, codes, programs


@st.composite
def two_programs(draw):
    """A random view program, and a second one over the first one's outputs."""
    sources, names, ops, outs = draw(programs())

    def first(sd):
        pool = [sd[n] for n in names]
        for op in ops:
            pool.append(_run(op, pool))
        return {f"m{k}": pool[k] for k in outs}

    middle = {k: (tuple(v.shape), torch.float32) for k, v in first(codes(sources)).items()}
    _, names2, ops2, outs2 = draw(programs(middle))

    def second(sd):
        pool = [sd[n] for n in names2]
        for op in ops2:
            pool.append(_run(op, pool))
        return {f"out{k}": pool[k] for k in outs2}

    return sources, first, second


@given(two_programs())
def test_two_conversions_in_a_row_are_one_conversion_of_the_first_ones_sources(program):
    sources, first, second = program
    conv = compile_conversion(Chain(first, second), sources)
    data = codes(sources)
    want = {k: v.contiguous() for k, v in second(first(data)).items()}
    got = apply_pieces(conv, data)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert set(conv.sources) == set(sources)
    assert conv.target_problems() == {}


def test_a_cast_in_either_conversion_composes_in_order():
    sources = {"w": ((4, 6), torch.float32)}
    conv = compile_conversion(
        Chain(lambda sd: {"x": sd["w"].t().to(torch.bfloat16)}, lambda sd: {"y": sd["x"][1:]}),
        sources,
    )
    (p,) = conv.targets["y"].pieces
    assert p.cast == ("bfloat16",) and conv.targets["y"].dtype == "bfloat16"
    conv = compile_conversion(
        Chain(lambda sd: {"x": sd["w"].to(torch.bfloat16)}, lambda sd: {"y": sd["x"].double()}),
        sources,
    )
    assert conv.targets["y"].pieces[0].cast == ("bfloat16", "float64")


def test_what_the_second_leaves_out_on_purpose_is_left_out_of_the_sources():
    sources = {"a": ((2, 3), torch.float32), "b": ((3,), torch.float32)}
    spec = {"rules": [{"from": "bb", "drop": "a cache"}]}
    conv = compile_conversion(Chain(lambda sd: {"aa": sd["a"], "bb": sd["b"]}, spec), sources)
    assert conv.dropped == {"b": "a cache"}
    assert conv.source_unused() == {}


# -------------------------------------------------------------------------------------------
class Fused(nn.Module):
    """q and kv fused in one parameter, split by its own state-dict hook (torchtitan's way).

    Rows interleave per group: [q0, q1, k, v] for each of 2 groups of 2-row heads.
    """

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Parameter(torch.randn(16, 3))
        self.register_state_dict_post_hook(self._split)
        self.calls: list[type] = []

    @staticmethod
    def _split(module: Any, sd: dict, prefix: str, local_metadata: Any) -> None:
        w = sd.pop(prefix + "wqkv")
        module.calls.append(type(w))
        g = w.reshape(2, 4, 2, 3)  # groups, (q0, q1, k, v), head rows, cols
        sd[prefix + "wq"] = g[:, :2].reshape(8, 3).contiguous()
        sd[prefix + "wk"] = g[:, 2].reshape(4, 3).contiguous()
        sd[prefix + "wv"] = g[:, 3].reshape(4, 3).contiguous()


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(5, 3)
        self.attn = Fused()
        self.out = nn.Linear(3, 5)


def saved(model: nn.Module, path: Any) -> Any:
    """What the model's own state_dict() writes (hooks run: this is the reference)."""
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_a_models_own_hooks_are_its_declared_conversion(tmp_path):
    model = Net()
    ref = saved(model, tmp_path / "m.safetensors")
    model.attn.calls.clear()
    assert has_own_hooks(model)
    assert set(live_layout(model)) == {
        "emb.weight", "attn.wqkv", "out.weight", "out.bias"
    }  # fmt: skip
    with unchanged(model):
        r = fsdpcheck.verify(model, ref)
    assert r.ok, str(r)
    assert any("Net's state-dict hooks" in n for n in r.notes), r.notes
    # The hook ran on shape-only tensors of a copy, never on the live parameter.
    assert model.attn.calls and all(c is not nn.Parameter for c in model.attn.calls)
    assert all(c.__name__ == "Traced" for c in model.attn.calls)
    assert fsdpcheck.fingerprint(model) == fsdpcheck.fingerprint_checkpoint(ref)


def test_a_planted_element_is_named_in_the_saved_layout_at_the_live_source(tmp_path):
    model = Net()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["attn.wk"][3, 1] += 1.0  # group 1's k, head row 1: wqkv row 4 + 2 * 2 + 1 = 13
    save_file(sd, str(tmp_path / "bad.safetensors"))
    r = fsdpcheck.verify(model, tmp_path / "bad.safetensors")
    (f,) = r.findings
    assert (f.key, f.max_abs_index, f.abs_source) == ("attn.wk", (3, 1), ("attn.wqkv", (13, 1)))


def test_loaded_through_its_hooks_in_place(tmp_path):
    ref = saved(Net(seed=0), tmp_path / "m.safetensors")
    model = Net(seed=1)
    wqkv = model.attn.wqkv
    r = fsdpcheck.load(model, ref)
    assert r.ok, str(r)
    assert model.attn.wqkv is wqkv  # written in place
    assert fsdpcheck.fingerprint(model) == fsdpcheck.fingerprint(Net(seed=0))


def test_a_stated_conversion_maps_what_state_dict_returns(tmp_path):
    """convert= is stated on the hooks' output (wq/wk/wv), as the model's library would."""
    model = Net()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    path = tmp_path / "renamed.safetensors"
    save_file({("model." + k): v.contiguous() for k, v in sd.items()}, str(path))

    def rename(state: dict) -> dict:
        assert "attn.wq" in state and "attn.wqkv" not in state
        return {"model." + k: v for k, v in state.items()}

    r = fsdpcheck.verify(model, path, convert=rename)
    assert r.ok, str(r)


def test_a_hook_that_is_not_a_strided_map_is_one_error_naming_it(tmp_path):
    model = Net()
    ref = saved(model, tmp_path / "m.safetensors")

    def scale(module: Any, sd: dict, prefix: str, local_metadata: Any) -> None:
        sd[prefix + "weight"] = sd[prefix + "weight"] * 2

    model.out.register_state_dict_post_hook(scale)
    r = fsdpcheck.verify(model, ref)
    (f,) = r.findings
    assert f.kind == "error" and "aten.mul" in f.message and "out.weight" in f.message
    with pytest.raises(ConversionError, match=r"aten\.mul"):
        compile_conversion(declared_conversion(model), {"out.weight": ((5, 3), torch.float32)})


def test_torchs_own_hooks_are_not_a_declared_conversion():
    """FSDP2's and FSDP1's state-dict hooks are torch's: get_model_state_dict handles them."""
    import functools

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    assert declared_conversion(nn.Linear(3, 4)) is None
    lin = nn.Linear(2, 2)
    torch_hook = functools.partial(_fsdp_param_group.FSDPParamGroup._register_state_dict_hooks)
    lin._register_state_dict_hook(torch_hook)
    assert not has_own_hooks(lin) and declared_conversion(lin) is None
    lin.register_state_dict_post_hook(lambda *a: None)
    assert has_own_hooks(lin)


def test_save_of_a_model_with_its_own_hooks_says_why_not(tmp_path):
    with pytest.raises(TypeError, match="own state-dict hooks"):
        fsdpcheck.save(Net(), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_pipeline_parts_with_hooks_are_one_model(tmp_path):
    """The stages a rank runs (named as in the whole model) declare their hooks together."""
    whole = Net()
    ref = saved(whole, tmp_path / "m.safetensors")
    first, second = nn.Module(), nn.Module()
    first.emb, first.attn = whole.emb, whole.attn
    second.out = whole.out
    r = fsdpcheck.verify([first, second], ref)
    assert r.ok, str(r)
    assert fsdpcheck.fingerprint([first, second]) == fsdpcheck.fingerprint_checkpoint(ref)


def test_loaded_through_its_hooks_with_sentinels_leaves_nothing_unwritten(tmp_path):
    """Sentinels go in first, then the converted pieces: every element written, none left."""
    ref = saved(Net(seed=0), tmp_path / "m.safetensors")
    model = Net(seed=1)
    r = fsdpcheck.load(model, ref, sentinel=True)
    assert r.ok, str(r)
    assert fsdpcheck.fingerprint(model) == fsdpcheck.fingerprint(Net(seed=0))
