"""Conversions checked against the libraries' own conversion code, run at test time.

torchtune 0.6.1 (``convert_weights.tune_to_hf`` / ``tune_to_meta`` through its HF and Meta
checkpointers), litgpt 0.5.13 (``convert_hf_checkpoint`` / ``convert_lit_checkpoint``: q, k, v
fused into one ``attn.qkv``), transformers 5.24 (GPT-2's Conv1D against an nn.Linear export;
Mixtral's stacked experts against its own ``save_pretrained``, nothing stated). Each clean
checkpoint is OK; each fault planted after the conversion names exactly its keys, and the one
changed element is named at its key and index with the live element it comes from
(``tests/convert_libs.py`` builds them). Every library is optional: a missing one skips.
torchtitan's own Llama3 (fused q/k/v under FSDP2) is in tests/test_convert_titan.py.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from typing import Any

import pytest
import torch

import fsdpcheck
from fsdpcheck.testing import unchanged
from tests import convert_libs as cl


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed (requirements-test-libs.txt)")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Builders run once per module, each only when a test needs it."""
    root = tmp_path_factory.mktemp("convert_libs")
    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            folder = root / name
            folder.mkdir()
            if name == "torchtune":
                _needs("torchtune", "transformers")
                hf = cl.torchtune_hf(folder)
                meta = cl.torchtune_meta(folder, _fresh_tune(hf.live))
                cache[name] = {"torchtune-hf": hf, "torchtune-meta": meta}
            elif name == "litgpt":
                _needs("litgpt", "transformers")
                a, b = cl.litgpt_cases(folder)
                cache[name] = {a.name: a, b.name: b}
            elif name == "gpt2":
                _needs("transformers")
                cache[name] = {"gpt2-linear": cl.gpt2_linear(folder)}
            elif name == "mixtral":
                _needs("transformers")
                cache[name] = {"mixtral": cl.mixtral_case(folder)}
        return cache[name]

    return {"get": get}


def _fresh_tune(model: Any) -> Any:
    """A second torchtune model holding the same values (the Meta round trip loads into it)."""
    import copy

    return copy.deepcopy(model)


CASES = {
    "torchtune-hf": "torchtune",
    "torchtune-meta": "torchtune",
    "litgpt-hf-to-lit": "litgpt",
    "litgpt-lit-to-hf": "litgpt",
    "gpt2-linear": "gpt2",
    "mixtral": "mixtral",
}
FAULTS = [
    ("torchtune-hf", "no_permute"),
    ("torchtune-hf", "gate_up_swapped"),
    ("torchtune-hf", "zeros"),
    ("torchtune-meta", "gate_up_swapped"),
    ("torchtune-meta", "zeros"),
    ("litgpt-hf-to-lit", "qkv_order"),
    ("litgpt-hf-to-lit", "gate_up_swapped"),
    ("litgpt-hf-to-lit", "zeros"),
    ("litgpt-lit-to-hf", "zeros"),
    ("gpt2-linear", "no_transpose"),
    ("gpt2-linear", "zeros"),
    ("mixtral", "experts_swapped"),
    ("mixtral", "gate_up_swapped"),
    ("mixtral", "zeros"),
]


def case_of(built: dict[str, Any], name: str) -> cl.LibCase:
    return built["get"](CASES[name])[name]


@pytest.mark.parametrize("name", list(CASES))
def test_clean_conversion_is_ok(built, name):
    """What the library's own converter wrote is OK through its own conversion function."""
    case = case_of(built, name)
    with unchanged(case.live):
        r = fsdpcheck.verify(case.live, case.clean, convert=case.convert)
    assert r.ok, str(r)
    # Every tensor of the file was compared (a tied duplicate is checked against its first).
    entries = fsdpcheck.fingerprint_checkpoint(case.clean)
    assert r.keys_b == len(entries) > 0
    assert r.keys_checked == r.keys_a >= r.keys_b
    assert r.elements_checked >= sum(math.prod(s) for s in _shapes(case.clean).values())


def _shapes(path: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in cl.read_file(cl.weights_file(path)).items()}


@pytest.mark.parametrize("name,fault", FAULTS, ids=[f"{n}-{f}" for n, f in FAULTS])
def test_planted_fault_names_exactly_its_keys(built, name, fault):
    case = case_of(built, name)
    path, keys = case.faults[fault]
    r = fsdpcheck.verify(case.live, path, convert=case.convert)
    assert not r.ok
    assert sorted(f.key for f in r.findings) == keys, str(r)
    assert {f.kind for f in r.findings} == {"value"}, str(r)


@pytest.mark.parametrize("name", list(CASES))
def test_one_changed_element_is_named_at_its_key_index_and_source(built, name):
    case = case_of(built, name)
    path, _ = case.faults["one_element"]
    r = fsdpcheck.verify(case.live, path, convert=case.convert)
    (f,) = r.findings
    assert (f.key, tuple(f.max_abs_index or ())) == case.plant, str(r)
    assert f.kind == "value" and f.mismatched == 1
    assert f.abs_source is not None and (f.abs_source[0], tuple(f.abs_source[1])) == case.source
    src, idx = case.source
    assert f"<- {src} ({', '.join(map(str, idx))})" in str(r)


@pytest.mark.parametrize("name", list(CASES))
def test_fingerprints_through_the_conversion_equal_the_files(built, name):
    """The live model's fingerprints in the file's coordinates, without the file's data."""
    case = case_of(built, name)
    convert = case.convert
    if convert is None:  # Mixtral: the library's own function save_pretrained runs
        from transformers.core_model_loading import revert_weight_conversion

        convert = functools.partial(revert_weight_conversion, case.live)
    live = fsdpcheck.fingerprint(case.live, convert=convert)
    file = fsdpcheck.fingerprint_checkpoint(case.clean)
    assert live == file
    planted = fsdpcheck.fingerprint_checkpoint(case.faults["one_element"][0])
    assert sorted(k for k in file if planted[k] != live[k]) == [case.plant[0]]


def test_mixtral_declares_its_layout_nothing_stated(built):
    """save_pretrained writes one key per expert from stacked experts: no statement needed."""
    case = case_of(built, "mixtral")
    r = fsdpcheck.verify(case.live, case.clean)
    assert r.ok, str(r)
    assert any("save_pretrained's layout" in n for n in r.notes), r.notes
    # Its state dict's own layout (a DCP of the stacked experts) still needs no conversion.
    fp = fsdpcheck.fingerprint(case.live)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fp
    # Loaded through the same declared layout into another Mixtral: the same values after.
    other = cl.mixtral(seed=1)
    before = fsdpcheck.fingerprint(other)
    r = fsdpcheck.load(other, case.clean, verify="full")
    assert r.ok, str(r)
    after = fsdpcheck.fingerprint(other)
    assert after == fp and after != before


def test_mixtral_with_tied_embeddings_saves_the_tie_once(tmp_path):
    """save_pretrained drops lm_head.weight (tied): the declared layout drops it the same way."""
    _needs("transformers")
    model = cl.mixtral(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    r = fsdpcheck.verify(model, tmp_path)
    assert r.ok, str(r)
    (row,) = [m for m in r.mapping if m.a == "lm_head.weight"]
    assert row.status == "ignored" and "tied to model.embed_tokens.weight" in row.reason
    other = cl.mixtral(seed=1, tied=True)
    assert fsdpcheck.load(other, tmp_path).ok
    assert fsdpcheck.fingerprint(other) == fsdpcheck.fingerprint(model)


def test_load_through_a_library_conversion(built):
    """torchtune's HF files loaded into a fresh torchtune model through tune_to_hf."""
    case = case_of(built, "torchtune-hf")
    other = _fresh_tune(case.live)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    r = fsdpcheck.load(other, case.clean, convert=case.convert, verify="full")
    assert r.ok, str(r)
    assert fsdpcheck.fingerprint(other) == fsdpcheck.fingerprint(case.live)


def test_litgpt_files_compared_through_litgpt_code(built):
    """lit_model.pth against the HF files convert_lit_checkpoint wrote, offline."""
    a = case_of(built, "litgpt-hf-to-lit")
    b = case_of(built, "litgpt-lit-to-hf")
    r = fsdpcheck.compare_checkpoints(a.clean, b.clean, convert=b.convert)
    assert r.ok, str(r)
    r = fsdpcheck.compare_checkpoints(a.clean, b.faults["one_element"][0], convert=b.convert)
    (f,) = r.findings
    assert (f.key, tuple(f.max_abs_index or ())) == b.plant
    # The fused qkv, split by litgpt's own code: the source named is the qkv row.
    assert f.abs_source is not None and f.abs_source[0] == "transformer.h.0.attn.qkv.weight"


def test_meta_and_hf_files_through_torchtunes_functions(built):
    """Meta layout vs HF layout: torchtune's meta_to_tune then tune_to_hf, one conversion."""
    from torchtune.models import convert_weights

    meta = case_of(built, "torchtune-meta")
    hf = case_of(built, "torchtune-hf")
    to_hf = hf.convert

    def meta_to_hf(sd: dict) -> dict:
        return to_hf(convert_weights.meta_to_tune(sd))

    r = fsdpcheck.compare_checkpoints(meta.clean, hf.clean, convert=meta_to_hf)
    assert r.ok, str(r)
    # Meta's own file holds rope.freqs, which meta_to_tune leaves out: on purpose, not a loss.
    assert meta.original is not None
    r = fsdpcheck.compare_checkpoints(meta.original, hf.clean, convert=meta_to_hf)
    assert r.ok, str(r)
    (row,) = [m for m in r.mapping if m.a == "rope.freqs"]
    assert row.status == "ignored" and "rotary cache" in row.reason
    # A weight a converter leaves out is not: it is named as unexpected.
    r = fsdpcheck.compare_checkpoints(
        meta.original,
        hf.clean,
        convert=lambda sd: meta_to_hf({k: v for k, v in sd.items() if k != "output.weight"}),
    )
    assert sorted((f.key, f.kind) for f in r.findings) == [
        ("lm_head.weight", "missing"),
        ("output.weight", "unexpected"),
    ], str(r)


def test_no_names_pair_says_so_once(built):
    """litgpt vs HF and Meta vs HF with no hint: one note, and the way to state it."""
    lit = case_of(built, "litgpt-hf-to-lit")
    hf = case_of(built, "torchtune-hf")
    meta = case_of(built, "torchtune-meta")
    assert meta.original is not None
    for a, b in ((lit.clean, hf.clean), (meta.original, hf.clean)):
        r = fsdpcheck.compare_checkpoints(a, b)
        notes = [n for n in r.notes if "the two sides use different naming" in n]
        assert len(notes) == 1, r.notes
        assert "convert=" in notes[0] and "key_map=" in notes[0]
        na = len(fsdpcheck.fingerprint_checkpoint(a))
        # At most one name in common (litgpt's lm_head.weight, Meta's norm.weight).
        assert re.match(rf"[01] of {na} names pair;", notes[0]), notes[0]
        assert len(r.findings) >= na  # the names themselves are listed as before


def test_a_forgotten_square_transpose_fails_by_value(built):
    """GPT-2's attn.c_proj keeps its shape transposed: only the values tell, and they do."""
    case = case_of(built, "gpt2-linear")
    path, keys = case.faults["no_transpose"]
    r = fsdpcheck.verify(case.live, path, convert=case.convert)
    for f in r.findings:
        assert f.key in keys and f.kind == "value"
        n = math.prod(case.live.get_parameter(f.key).shape)
        assert f.mismatched > n // 2  # nearly every element off, not one


def test_cli_converts_by_a_library_function_named_module_attr(built, capsys):
    """``--convert torchtune.models.convert_weights:tune_to_meta`` on the command line."""
    import json

    from fsdpcheck.cli import main

    meta = case_of(built, "torchtune-meta")
    assert meta.original is not None
    # Meta's file in torchtune's names (meta_to_tune takes no arguments: named as it is).
    how = "torchtune.models.convert_weights:meta_to_tune"
    capsys.readouterr()
    assert main(["fingerprint", str(meta.original), "--convert", how, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    from torchtune.models import convert_weights

    want = fsdpcheck.fingerprint_checkpoint(meta.original, convert=convert_weights.meta_to_tune)
    assert got == {k: f"0x{v:016x}" for k, v in want.items()}
    # ... which are the live torchtune model's, whose weights that file holds.
    assert want == fsdpcheck.fingerprint(meta.live)
