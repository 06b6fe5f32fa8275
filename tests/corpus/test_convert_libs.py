"""Conversions checked against the libraries' own conversion code, run at test time.

torchtune 0.6.1 (``convert_weights.tune_to_hf`` / ``tune_to_meta`` through its HF and Meta
checkpointers), litgpt 0.5.13 (``convert_hf_checkpoint`` / ``convert_lit_checkpoint``: q, k, v
fused into one ``attn.qkv``), transformers 5.24 (GPT-2's Conv1D against an nn.Linear export;
Mixtral's stacked experts against its own ``save_pretrained``, nothing stated). Each clean
checkpoint is OK; each fault planted after the conversion names exactly its keys, and the one
changed element is named at its key and index with the live element it comes from
(``tests/corpus/convert_libs.py`` builds them and runs the checks). Every library is optional: a
missing one skips. torchtune runs in a child process (tests/corpus/convert_tune.py: its torchao
would stop peft in this one). torchtitan's own Llama3 (fused q/k/v under FSDP2) is in
tests/corpus/test_convert_titan.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fsdpcheck
from tests import REPO_ROOT
from tests.corpus import convert_libs as cl

REPO = REPO_ROOT
#: Where scripts/setup.sh puts the torchao torchtune needs (see tests/corpus/convert_tune.py).
TORCHAO = Path(sys.prefix) / "torchao-for-torchtune"


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed (scripts/setup.sh installs it)")


def _tune(root: Path) -> dict[str, Any]:
    """torchtune's cases, built and checked in a child process (its torchao on its path)."""
    _needs("torchtune", "transformers")
    if not (TORCHAO / "torchao").is_dir():
        pytest.skip(f"{TORCHAO} holds no torchao (scripts/setup.sh installs it)")
    got = subprocess.run(
        [sys.executable, "-m", "tests.corpus.convert_tune", str(root), str(TORCHAO)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Builders run once per module, each only when a test needs it."""
    root = tmp_path_factory.mktemp("convert_libs")
    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            # Every library is checked before the folder exists, so that a missing one skips
            # each test that needs it (not only the first) and a failed build fails each one
            # with its own error rather than "File exists".
            needs = {"torchtune": ("torchtune",), "litgpt": ("litgpt",)}.get(name, ())
            _needs(*needs, "transformers")
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            if name == "torchtune":
                got = _tune(folder)
                cache[name] = {k: ("results", v) for k, v in got.items()}
            elif name == "litgpt":
                a, b = cl.litgpt_cases(folder)
                cache[name] = {a.name: a, b.name: b}
            elif name == "gpt2":
                cache[name] = {"gpt2-linear": cl.gpt2_linear(folder)}
            elif name == "mixtral":
                cache[name] = {"mixtral": cl.mixtral_case(folder)}
        return cache[name]

    return {"get": get, "checks": {}}


CASES = {
    "torchtune-hf": "torchtune",
    "torchtune-meta": "torchtune",
    "litgpt-hf-to-lit": "litgpt",
    "litgpt-lit-to-hf": "litgpt",
    "gpt2-linear": "gpt2",
    "mixtral": "mixtral",
}
#: Where each case's (and torchtune's other checks') results come from.
LIBRARY = {**CASES, "extra": "torchtune"}
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
    got = built["get"](CASES[name])[name]
    assert isinstance(got, cl.LibCase)
    return got


def results_of(built: dict[str, Any], name: str) -> dict[str, Any]:
    """The checks of a case (``convert_libs.checks``), run once, where its library lives."""
    got = built["get"](LIBRARY[name])[name]
    if isinstance(got, tuple):
        return got[1]
    if name not in built["checks"]:
        built["checks"][name] = cl.checks(got)
    return built["checks"][name]


@pytest.mark.parametrize("name", list(CASES))
def test_clean_conversion_is_ok(built, name):
    """What the library's own converter wrote is OK through its own conversion function."""
    r = results_of(built, name)
    clean = r["clean"]
    assert clean["ok"], clean["text"]
    # Every tensor of the file was compared (a tied duplicate is checked against its first).
    keys_a, keys_b, checked = clean["keys"]
    assert keys_b == r["file_entries"] > 0
    assert checked == keys_a >= keys_b
    assert clean["elements"] >= r["file_elements"]


@pytest.mark.parametrize("name,fault", FAULTS, ids=[f"{n}-{f}" for n, f in FAULTS])
def test_planted_fault_names_exactly_its_keys(built, name, fault):
    got = results_of(built, name)["faults"][fault]
    r = got["report"]
    assert not r["ok"]
    assert sorted(f[0] for f in r["findings"]) == got["expected"], r["text"]
    assert {f[1] for f in r["findings"]} == {"value"}, r["text"]


@pytest.mark.parametrize("name", list(CASES))
def test_one_changed_element_is_named_at_its_key_index_and_source(built, name):
    got = results_of(built, name)
    r = got["faults"]["one_element"]["report"]
    ((key, kind, index, mismatched),) = r["findings"]
    assert [key, index] == got["plant"], r["text"]
    assert kind == "value" and mismatched == 1
    assert r["sources"] == [got["source"]]
    src, idx = got["source"]
    assert f"<- {src} ({', '.join(map(str, idx))})" in r["text"]


@pytest.mark.parametrize("name", list(CASES))
def test_fingerprints_through_the_conversion_equal_the_files(built, name):
    """The live model's fingerprints in the file's coordinates, without the file's data."""
    got = results_of(built, name)
    assert got["fingerprints_equal"]
    assert got["planted_differs"] == [got["plant"][0]]


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
    extra = results_of(built, "extra")
    assert extra["load"]["ok"], extra["load"]["text"]
    assert extra["load_equal"]


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
    # The way back: lit_model.pth fingerprinted in HF's names equals the HF file's.
    assert fsdpcheck.fingerprint_checkpoint(a.clean, convert=b.convert) == (
        fsdpcheck.fingerprint_checkpoint(b.clean)
    )


def test_meta_and_hf_files_through_torchtunes_functions(built):
    """Meta layout vs HF layout: torchtune's meta_to_tune then tune_to_hf, one conversion."""
    extra = results_of(built, "extra")
    assert extra["meta_vs_hf"]["ok"], extra["meta_vs_hf"]["text"]
    # Meta's own file holds rope.freqs, which meta_to_tune leaves out: on purpose, not a loss.
    r = extra["meta_original_vs_hf"]
    assert r["ok"], r["text"]
    (row,) = [m for m in r["mapping"] if m[0] == "rope.freqs"]
    assert row[2] == "ignored" and "rotary cache" in row[3]
    # A weight a converter leaves out is not: it is named as unexpected.
    r = extra["weight_left_out"]
    assert sorted((f[0], f[1]) for f in r["findings"]) == [
        ("lm_head.weight", "missing"),
        ("output.weight", "unexpected"),
    ], r["text"]


def test_no_names_pair_says_so_once(built):
    """litgpt vs HF and Meta vs HF with no hint: one note, and the way to state it."""
    lit = case_of(built, "litgpt-hf-to-lit")
    hf = case_of(built, "litgpt-lit-to-hf")  # HF's names, written by convert_lit_checkpoint
    r = fsdpcheck.compare_checkpoints(lit.clean, hf.clean)
    meta = results_of(built, "extra")
    got = [
        (r.notes, len(r.findings), len(fsdpcheck.fingerprint_checkpoint(lit.clean))),
        (meta["meta_vs_hf_no_hint"]["notes"], len(meta["meta_vs_hf_no_hint"]["findings"]),
         meta["meta_entries"]),
    ]  # fmt: skip
    for notes, findings, na in got:
        said = [n for n in notes if "the two sides use different naming" in n]
        assert len(said) == 1, notes
        assert "convert=" in said[0] and "key_map=" in said[0]
        # At most one name in common (litgpt's lm_head.weight, Meta's norm.weight).
        assert re.match(rf"[01] of {na} names pair;", said[0]), said[0]
        assert findings >= na  # the names themselves are listed as before


def test_a_forgotten_square_transpose_fails_by_value(built):
    """GPT-2's attn.c_proj keeps its shape transposed: only the values tell, and they do."""
    case = case_of(built, "gpt2-linear")
    path, keys = case.faults["no_transpose"]
    r = fsdpcheck.verify(case.live, path, convert=case.convert)
    assert sorted(f.key for f in r.findings) == keys
    for f in r.findings:
        n = case.live.get_parameter(f.key).numel()
        assert f.kind == "value" and f.mismatched > n // 2  # nearly every element off


def test_cli_converts_by_a_library_function_named_module_attr(built):
    """``--convert torchtune.models.convert_weights:meta_to_tune`` on the command line: the
    fingerprints of Meta's file in torchtune's names, which are the live torchtune model's."""
    extra = results_of(built, "extra")
    assert extra["cli_rc"] == 0
    assert extra["cli_equal"] and extra["cli_is_live"]
