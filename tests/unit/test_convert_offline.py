"""compare and fingerprint_checkpoint through a conversion: clean files pass, planted faults are
named at the target's key and index with the source's, nothing else.

The source checkpoint is a DCP step in the source layout, the converted one a safetensors file
in the target layout (``tests/convert_cases``), written from real data by the conversion itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import fsdpcheck
from fsdpcheck.convert import compile_conversion
from tests import convert_cases as cc

WAYS = {
    "callable": lambda: cc.to_hf,
    "adapter": lambda: cc.Adapter(),
    "spec": lambda: cc.SPEC,
}


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("src") / "step-1"
    dcp.save(cc.source_state(), checkpoint_id=str(path), no_dist=True)
    return path


def write(tmp_path, sd, name="model.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def value_keys(report):
    return sorted(f.key for f in report.findings if f.kind == "value")


@pytest.mark.parametrize("way", list(WAYS))
def test_clean_conversion_is_ok_stated_each_way(way, source_dir, tmp_path):
    hf = write(tmp_path, cc.converted(cc.source_state()))
    r = fsdpcheck.compare_checkpoints(source_dir, hf, convert=WAYS[way]())
    assert r.ok, str(r)
    assert r.keys_checked == 2 + 10 * cc.LAYERS
    assert r.elements_checked == sum(v.numel() for v in cc.source_state().values())


def test_without_the_conversion_the_report_says_the_naming_differs(source_dir, tmp_path):
    hf = write(tmp_path, cc.converted(cc.source_state()))
    r = fsdpcheck.compare_checkpoints(source_dir, hf)
    assert not r.ok
    assert any("1 of 22 names pair; the two sides use different naming" in n for n in r.notes), (
        r.notes
    )
    assert any("--convert" in n for n in r.notes)


def test_one_element_changed_after_conversion_is_named_at_both_ends(source_dir, tmp_path):
    sd = cc.converted(cc.source_state())
    key = "model.layers.1.self_attn.q_proj.weight"
    sd[key][21, 5] += 1.0
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd), convert=cc.to_hf)
    (f,) = r.findings
    assert (f.key, f.kind, f.mismatched, f.numel) == (key, "value", 1, cc.H * cc.HD * cc.DIM)
    assert f.max_abs_index == (21, 5)
    # Row 21 of head 2 (rows 16..23): the second half, pair 1 -> source row 16 + 2 * 1 + 1.
    assert f.abs_source == ("layers.1.attention.wq.weight", (19, 5))
    assert "at index (21, 5) <- layers.1.attention.wq.weight (19, 5)" in f.describe()


@pytest.mark.parametrize(("fault", "keys"), list(cc.FAULTS.items()))
def test_planted_conversion_bugs_name_exactly_the_affected_keys(fault, keys, source_dir, tmp_path):
    sd = cc.faulty(fault)
    for way in WAYS:
        r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd), convert=WAYS[way]())
        assert value_keys(r) == sorted(keys), (way, str(r))
        assert [f.kind for f in r.findings] == ["value"] * len(keys)


def test_experts_swapped_points_at_the_source_expert(source_dir, tmp_path):
    sd = cc.converted(cc.source_state())
    key = "model.layers.1.mlp.experts.w1"
    sd[key] = sd[key][[0, 2, 1]].clone()
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd), convert=cc.SPEC)
    (f,) = r.findings
    expert, row, col = f.max_abs_index
    assert expert in (1, 2) and f.abs_source == (f"layers.1.moe.experts.{expert}.w1", (row, col))


def test_a_cast_compares_exactly_as_round_to_nearest_even(source_dir, tmp_path):
    src = cc.source_state()
    sd = cc.converted(src, cc.to_hf_bf16)
    assert fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd), convert=cc.to_hf_bf16).ok
    # One bf16 step off at one element: inside bf16's default tolerance, but not the cast.
    key = "model.norm.weight"
    bad = dict(sd)
    bad[key] = sd[key].clone()
    bits = bad[key].view(torch.int16)
    bits[3] += 1
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, bad), convert=cc.to_hf_bf16)
    assert [(f.key, f.max_abs_index) for f in r.findings] == [(key, (3,))]
    # A converter that truncates instead of rounding: caught at about half the elements.
    trunc = dict(sd)
    w = src["norm.weight"]
    trunc[key] = (w.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, trunc), convert=cc.to_hf_bf16)
    (f,) = r.findings
    assert f.key == key and 0 < f.mismatched < cc.DIM
    # A tolerance given is used instead.
    r = fsdpcheck.compare_checkpoints(
        source_dir, write(tmp_path, bad), convert=cc.to_hf_bf16, rtol=1.6e-2, atol=1e-5
    )
    assert r.ok, str(r)


def test_coverage_unused_dropped_and_gap(source_dir, tmp_path):
    sd = cc.converted(cc.source_state())
    del sd["model.norm.weight"]
    hf = write(tmp_path, sd)

    def drops_norm(state):
        out = cc.to_hf(state)
        del out["model.norm.weight"]
        return out

    r = fsdpcheck.compare_checkpoints(source_dir, hf, convert=drops_norm)
    assert [(f.key, f.kind) for f in r.findings] == [("norm.weight", "unexpected")]
    assert "32 of its 32 elements in actual are in no tensor" in r.findings[0].message
    spec = json.loads(json.dumps(cc.SPEC))
    spec["rules"] = [r_ for r_ in spec["rules"] if r_["from"] != "norm.weight"]
    spec["rules"].append({"from": "norm.weight", "drop": "recomputed on load"})
    r = fsdpcheck.compare_checkpoints(source_dir, hf, convert=spec)
    assert r.ok, str(r)
    assert any(
        row.a == "norm.weight" and row.status == "ignored" and "recomputed on load" in row.reason
        for row in r.mapping
    )

    # Half of one source read: its other half is named.
    def half(state):
        out = drops_norm(state)
        out["model.layers.0.mlp.down_proj.weight"] = state["layers.0.feed_forward.w2.weight"][:16]
        return out

    sd2 = dict(sd)
    sd2["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:16]
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd2), convert=half)
    got = {(f.key, f.kind): f.message for f in r.findings}
    assert "384 of its 768 elements" in got[("layers.0.feed_forward.w2.weight", "unexpected")]
    assert "[16:32, 0:24]" in got[("layers.0.feed_forward.w2.weight", "unexpected")]
    # A compiled conversion whose pieces leave a gap: a gap finding, the key never compared.
    sources = {k: (tuple(v.shape), v.dtype) for k, v in cc.source_state().items()}
    conv = compile_conversion(cc.to_hf, sources).to_spec()
    for t in conv["targets"]:
        if t["name"] == "model.layers.0.mlp.gate_up_proj.weight":
            t["pieces"] = t["pieces"][:1]
    full = write(tmp_path, cc.converted(cc.source_state()))
    r = fsdpcheck.compare_checkpoints(source_dir, full, convert=conv)
    got = {(f.key, f.kind): f.message for f in r.findings}
    assert "gap at [24:48" in got[("model.layers.0.mlp.gate_up_proj.weight", "gap")]
    assert ("layers.0.feed_forward.w3.weight", "unexpected") in got


def test_shape_and_dtype_findings_through_a_conversion(source_dir, tmp_path):
    sd = cc.converted(cc.source_state())
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :10]
    sd["model.norm.weight"] = sd["model.norm.weight"].double()
    r = fsdpcheck.compare_checkpoints(source_dir, write(tmp_path, sd), convert=cc.to_hf)
    got = {(f.key, f.kind): f.message for f in r.findings}
    assert got[("model.layers.0.mlp.down_proj.weight", "shape")] == (
        "global shape (32, 24) in actual but (32, 10) in expected"
    )
    assert (
        got[("model.norm.weight", "dtype")]
        == "torch.float32 in actual but torch.float64 in expected"
    )


def test_a_memory_budget_smaller_than_a_tensor_still_checks_every_element(source_dir, tmp_path):
    sd = cc.converted(cc.source_state())
    sd["model.layers.1.self_attn.q_proj.weight"][30, 31] = 7.0
    hf = write(tmp_path, sd)
    r = fsdpcheck.compare_checkpoints(source_dir, hf, convert=cc.SPEC, memory_budget=1024)
    assert value_keys(r) == ["model.layers.1.self_attn.q_proj.weight"]
    assert r.findings[0].max_abs_index == (30, 31)
    assert r.elements_checked == sum(v.numel() for v in cc.source_state().values())


@pytest.mark.parametrize("way", list(WAYS))
def test_fingerprint_through_a_conversion_equals_the_converted_file(way, source_dir, tmp_path):
    for fn in (cc.to_hf, cc.to_hf_bf16):
        hf = write(tmp_path, cc.converted(cc.source_state(), fn))
        want = fsdpcheck.fingerprint_checkpoint(hf)
        convert = fn if fn is cc.to_hf_bf16 else WAYS[way]()
        got = fsdpcheck.fingerprint_checkpoint(source_dir, convert=convert, memory_budget=2048)
        assert got == want
    plain = fsdpcheck.fingerprint_checkpoint(source_dir)
    assert set(plain) == set(cc.source_state())


def test_cli_convert_by_module_attr_and_by_spec_file(source_dir, tmp_path, capsys):
    from fsdpcheck.cli import main

    hf = write(tmp_path, cc.converted(cc.source_state()))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(cc.SPEC))
    for how in ("tests.convert_cases:to_hf", "tests.convert_cases:ADAPTER", str(spec)):
        assert main(["compare", str(source_dir), str(hf), "--convert", how]) == 0, how
    sd = cc.converted(cc.source_state())
    sd["model.layers.0.mlp.experts.w1"][2, 3, 4] = 0.0
    bad = write(tmp_path, sd, "bad.safetensors")
    capsys.readouterr()
    assert main(["compare", str(source_dir), str(bad), "--convert", str(spec)]) == 1
    out = capsys.readouterr().out
    assert "at index (2, 3, 4) <- layers.0.moe.experts.2.w1 (3, 4)" in out
    assert main(["fingerprint", str(source_dir), "--convert", str(spec), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["fingerprint", str(hf), "--json"]) == 0
    assert got == json.loads(capsys.readouterr().out)
    # A conversion that is not a strided map: one line, exit 2.
    assert main(["compare", str(source_dir), str(hf), "--convert", "no/such.json"]) == 2
    err = capsys.readouterr().err
    assert "neither a spec file nor 'module:attr'" in err and len(err.strip().splitlines()) == 1
