"""fsdpcheck against checkpoints written by the trainer libraries' own save code.

transformers folders (and accelerate's sharded .bin saves of the same model) are built in
this process; every multi-rank checkpoint (plain DCP, torchtitan, Lightning Fabric, accelerate,
DeepSpeed, megatron-core) is built by ONE ``torchrun --nproc-per-node 2`` launch, and the
live-model checks run in a second one (see tests/corpus/). A library that is not installed, or
cannot save on CPU ranks, skips with the reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpcheck
from tests import REPO_ROOT
from tests.corpus import Case, changed, collect, read_cases, snapshot

ROOT = REPO_ROOT
# Every builder module's cases (tests/corpus/*.py: CASES): in this process, or by the launch.
BUILDERS = collect()
HF_NAMES = [n for c in BUILDERS if not c.dist for n in c.names]
DIST_NAMES = [n for c in BUILDERS if c.dist for n in c.names]
LIVE_NAMES = [n for c in BUILDERS if c.dist for n in c.live]
# The library each case comes from: a build that could not run is one skipped case under it.
LIBRARY = {n: c.library for c in BUILDERS for n in c.names}
# Layouts whose checkpoints hold the same keys fingerprint() gives a live model and optimizer.
SAME_NAMES = ("transformers", "torchtitan", "accelerate", "dcp", "lightning")


def _torchrun(module: str, *args: str, timeout: float = 180) -> None:
    # PYTHONFAULTHANDLER: a rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's
    # Python stack, which the failure message below then shows.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", module, *args]  # --standalone: a free port of its own
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        # torchrun's own report fills the tail; what the failing rank printed comes before it.
        # The first lines that name an error (a rank's own come first), then the tail.
        said = [ln for ln in proc.stderr.splitlines() if _RANK_ERROR.search(ln)]
        raise RuntimeError(
            f"{module} failed ({proc.returncode}):\n" + "\n".join(said[:40])
            + f"\n--- last lines ---\n{proc.stderr[-4000:]}"
        )  # fmt: skip


_RANK_ERROR = re.compile(r"Error|Exception|terminate|Traceback|File \"|assert|Abort|Fatal")


@pytest.fixture(scope="module")
def hf_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    from tests.corpus import resolve

    root = tmp_path_factory.mktemp("hf")
    built: dict[str, Case] = {}
    for c in BUILDERS:
        if not c.dist:
            pytest.importorskip(c.requires, reason=f"{c.requires} is not installed")
            built.update((case.name, case) for case in resolve(c.target)(root))
    return built


@pytest.fixture(scope="module")
def dist_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Case], list[dict]]:
    root = tmp_path_factory.mktemp("corpus")
    _torchrun("tests.corpus.build_dist", str(root))
    cases = read_cases(root / "cases.json")
    _torchrun("tests.corpus.check_dist", str(root))
    checks = [json.loads((root / f"check_{r}.json").read_text()) for r in range(2)]
    return cases, checks


@pytest.fixture(params=HF_NAMES + DIST_NAMES)
def case(request: pytest.FixtureRequest) -> Case:
    if request.param in HF_NAMES:
        c = request.getfixturevalue("hf_cases").get(request.param)
    else:
        cases, _ = request.getfixturevalue("dist_corpus")
        c = cases.get(request.param)
        if c is None:  # the library's build could not run: one skipped case under its name
            c = next((x for x in [cases.get(LIBRARY[request.param])] if x and x.skip), None)
    if c is None:
        pytest.fail(f"the corpus build wrote no case {request.param}")
    if c.skip:
        pytest.skip(f"{c.library}: {c.skip}")
    return c


def test_every_case_built_is_one_its_builder_names(
    hf_cases: dict[str, Case], dist_corpus: tuple[dict[str, Case], list[dict]]
) -> None:
    # A builder's CASES is what the tests run over: a case it writes and does not name would
    # go unchecked, one it names and does not write fails in `case` above.
    cases, _ = dist_corpus
    skipped = {n for n, c in cases.items() if c.skip}
    assert set(cases) - skipped == set(DIST_NAMES) - {
        n for n in DIST_NAMES if LIBRARY[n] in skipped
    }
    assert set(hf_cases) == set(HF_NAMES)
    for c in BUILDERS:
        assert set(c.live) <= set(c.names), c.library


def _values(report: fsdpcheck.Report) -> set[tuple[str, tuple[int, ...]]]:
    return {(f.key, tuple(f.max_abs_index or ())) for f in report.findings if f.kind == "value"}


def _expected(case: Case) -> set[tuple[str, tuple[int, ...]]]:
    return {(p.key, tuple(p.index)) for p in case.planted}


def _by_id(case: Case, key: str) -> str:
    """Offline, integer-id optimizer state has no FQN to name it by: its id is acceptable.

    The id is the parameter's position in ``named_parameters()`` order (torch's rule).
    """
    from tests.corpus import TOY_FQNS

    if not case.extra.get("variant", "").startswith("ids") or not key.startswith("optim.state."):
        return key
    for i, fqn in enumerate(TOY_FQNS):
        if key.startswith(f"optim.state.{fqn}."):
            return f"optim.state.{i}.{key[len(f'optim.state.{fqn}.') :]}"
    return key


def _offline_names(case: Case, names: set[str]) -> set[str]:
    """`names` with id-named optimizer keys read as their canonical FQN names."""
    back = {_by_id(case, k): k for k in case.tensor_keys}
    return {back.get(n, n) for n in names}


# ---------------------------------------------------------------- layout, inspect, audit
def test_layout_recognised(case: Case) -> None:
    info = fsdpcheck.describe_path(case.path)
    assert info.layout == case.expected_layout, info.description
    assert info.description and "\n" not in info.description


def test_cli_inspect_names_layout(case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    from fsdpcheck.cli import main

    code = main(["inspect", case.path, "--show-mapping"])  # in-process: no torch import per case
    out = capsys.readouterr().out
    assert code == 0, out
    first = next(line for line in out.splitlines() if line.startswith("layout:"))
    assert first.split()[1] == case.expected_layout
    for key in case.tensor_keys[:3]:
        assert key in out  # the mapping table names the canonical keys


def test_audit_clean(case: Case) -> None:
    if case.name == "deepspeed_zero3":
        pytest.skip("placeholders: see test_deepspeed_zero3_placeholders_never_pass")
    r = fsdpcheck.audit(case.path)
    assert r.ok, str(r)


# ---------------------------------------------------------------- compare
def test_compare_clean_counts(case: Case) -> None:
    if case.name == "deepspeed_zero3":
        pytest.skip("placeholders: see test_deepspeed_zero3_placeholders_never_pass")
    r = fsdpcheck.compare_checkpoints(case.path, case.path)
    n = (
        len(case.tensor_keys)
        if case.optim_tensor_keys or not case.name.startswith("deep")
        else None
    )
    assert r.ok, str(r)
    if n is not None:
        assert (r.keys_a, r.keys_b, r.keys_checked) == (n, n, n), r.summary()
        assert f"{n} keys on" in r.summary() and f"{n} compared, 0 skipped" in r.summary()
    compared = _offline_names(case, {m.a for m in r.mapping if m.status == "compared"})
    assert set(case.model_keys) <= compared
    assert set(case.optim_tensor_keys) <= compared
    notes = "\n".join(r.notes)
    for entry in case.non_tensor_keys:
        assert entry in notes, f"non-tensor entry {entry} not named in the notes"


def test_compare_planted_named_at_index(case: Case) -> None:
    r = fsdpcheck.compare_checkpoints(case.planted_path, case.path)
    assert not r.ok
    got = {(_offline_names(case, {k}).pop(), i) for k, i in _values(r)}
    if case.name == "deepspeed_zero3":
        # The weight lives in the flat fp32 partition: named there, or the placeholders are
        # skipped findings; it may never pass.
        assert got or r.by_kind("skipped"), str(r)
        return
    assert got == _expected(case), str(r)
    assert {f.kind for f in r.findings} == {"value"}, str(r)


def test_compare_ignore(case: Case) -> None:
    if case.name == "deepspeed_zero3":
        pytest.skip("placeholders: see test_deepspeed_zero3_placeholders_never_pass")
    ignore = [_by_id(case, p.key) for p in case.planted]
    r = fsdpcheck.compare_checkpoints(case.planted_path, case.path, ignore=ignore)
    assert r.ok, str(r)
    ignored = {m.a for m in r.mapping if m.status == "ignored"} | {
        m.b for m in r.mapping if m.status == "ignored"
    }
    assert set(ignore) <= ignored


# ---------------------------------------------------------------- fingerprints
def test_fingerprint_checkpoint_keys_and_planted(case: Case) -> None:
    if case.name == "deepspeed_zero3":
        pytest.skip("placeholders: see test_deepspeed_zero3_placeholders_never_pass")
    clean = fsdpcheck.fingerprint_checkpoint(case.path)
    planted = fsdpcheck.fingerprint_checkpoint(case.planted_path)
    names = _offline_names(case, set(clean))
    assert set(case.tensor_keys) <= names
    if case.expected_layout in SAME_NAMES:
        assert names == set(case.tensor_keys)
    differ = {k for k in clean if clean[k] != planted.get(k)}
    assert _offline_names(case, differ) == {p.key for p in case.planted}


# ---------------------------------------------------------------- transformers, live
@pytest.mark.parametrize("name", [n for c in BUILDERS if not c.dist for n in c.live])
def test_hf_verify_live(hf_cases: dict[str, Case], name: str) -> None:
    from tests.corpus import resolve

    case = hf_cases[name]
    model = resolve(case.make_live)()
    before = snapshot(model)
    r = fsdpcheck.verify(model, case.path)
    assert changed(before, snapshot(model)) == []
    assert r.ok, str(r)
    # Every live name is checked: a tied one against the key the checkpoint holds.
    assert r.keys_checked == len(case.model_keys) + len(case.tied)
    tied_rows = [m for m in r.mapping if m.status == "tied"]
    if case.tied:
        assert [(m.a, m.b) for m in tied_rows] == list(case.tied.items())
        assert any("lm_head.weight" in n and "model.embed_tokens.weight" in n for n in r.notes)
    else:
        assert tied_rows == []
    planted = fsdpcheck.verify(model, case.planted_path)
    assert changed(before, snapshot(model)) == []
    got = _values(planted)
    assert _expected(case) <= got, str(planted)
    extra = got - _expected(case)
    # A tied live weight may be reported under its second name as well, never elsewhere.
    assert {k for k, _ in extra} <= set(case.tied), str(planted)


@pytest.mark.parametrize("name", [n for c in BUILDERS if not c.dist for n in c.live])
def test_hf_fingerprint_live_equals_checkpoint(hf_cases: dict[str, Case], name: str) -> None:
    from tests.corpus import resolve

    case = hf_cases[name]
    model = resolve(case.make_live)()
    before = snapshot(model)
    live = fsdpcheck.fingerprint(model)
    assert changed(before, snapshot(model)) == []
    assert sorted(live) == case.model_keys  # a tied weight once, under its first name
    assert live == fsdpcheck.fingerprint_checkpoint(case.path)


def test_hf_cli_compare_exit_codes(hf_cases: dict[str, Case], tmp_path: Path) -> None:
    case = hf_cases["hf_untied_sharded"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fsdpcheck", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert cli("compare", case.path, case.path).returncode == 0
    bad = cli("compare", case.planted_path, case.path)
    assert bad.returncode == 1 and "lm_head.weight" in bad.stdout
    as_json = cli("compare", case.planted_path, case.path, "--json")
    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    assert [f["key"] for f in doc["findings"]] == ["lm_head.weight"]
    assert cli("compare", case.planted_path, case.path, "--ignore", "lm_head.*").returncode == 0
    assert cli("compare", str(tmp_path / "nothing"), case.path).returncode == 2


# ---------------------------------------------------------------- multi-rank, live
@pytest.mark.parametrize("name", LIVE_NAMES)
def test_live_checks(dist_corpus: tuple[dict[str, Case], list[dict]], name: str) -> None:
    cases, checks = dist_corpus
    case = cases.get(name)
    if case is None or case.skip:
        pytest.skip(case.skip if case else f"{name} was not built")
    r0, r1 = (c[name] for c in checks)
    assert "__crash__" not in r0, r0.get("__crash__")
    for call in ("verify", "verify_planted", "fingerprint", "verify_no_state"):
        # Read-only by construction, on every rank; the same verdict everywhere.
        assert r0[call]["changed"] == [] and r1[call]["changed"] == [], call
        assert r0[call].get("result") == r1[call].get("result"), call
        assert "error" not in r0[call], r0[call].get("traceback")
    clean = r0["verify"]["result"]
    n = len(case.tensor_keys)
    assert clean["ok"], clean["text"]
    assert (clean["keys_a"], clean["keys_b"], clean["keys_checked"]) == (n, n, n), clean["summary"]
    planted = r0["verify_planted"]["result"]
    got = {(k, tuple(i or ())) for k, kind, i in planted["findings"] if kind == "value"}
    assert got == _expected(case), planted["text"]
    assert {kind for _, kind, _ in planted["findings"]} == {"value"}, planted["text"]
    no_state = r0["verify_no_state"]["result"]
    assert not no_state["ok"]
    assert any(k.startswith("optim") for k, _, _ in no_state["findings"]), no_state["text"]


@pytest.mark.parametrize("name", [n for n in LIVE_NAMES if not n.startswith("dcp_ids")])
def test_live_fingerprint_equals_checkpoint(
    dist_corpus: tuple[dict[str, Case], list[dict]], name: str
) -> None:
    cases, checks = dist_corpus
    case = cases.get(name)
    if case is None or case.skip:
        pytest.skip(case.skip if case else f"{name} was not built")
    live = checks[0][name]["fingerprint"]
    assert "error" not in live, live.get("traceback")
    offline = {k: f"{v:016x}" for k, v in fsdpcheck.fingerprint_checkpoint(case.path).items()}
    assert live["result"] == offline


# ---------------------------------------------------------------- DeepSpeed specifics
def test_deepspeed_zero3_placeholders_never_pass(
    dist_corpus: tuple[dict[str, Case], list[dict]],
) -> None:
    cases, _ = dist_corpus
    case = cases.get("deepspeed_zero3")
    if case is None or case.skip:
        pytest.skip(case.skip if case else "deepspeed_zero3 was not built")
    # Either the values are rebuilt from the flat partitions (fingerprints equal to the full
    # parameters'), or every placeholder is a finding: never "0 elements, complete".
    try:
        fp = fsdpcheck.fingerprint_checkpoint(case.path)
    except Exception:
        fp = {}
    expected = case.extra["model_fingerprints"]
    if all(fp.get(k) == v for k, v in expected.items()):
        return
    r = fsdpcheck.audit(case.path)
    assert not r.ok
    named = {f.key for f in r.findings}
    assert set(case.model_keys) <= named, str(r)


def test_deepspeed_zero2_model_values(dist_corpus: tuple[dict[str, Case], list[dict]]) -> None:
    cases, _ = dist_corpus
    case = cases.get("deepspeed_zero2")
    if case is None or case.skip:
        pytest.skip(case.skip if case else "deepspeed_zero2 was not built")
    fp = fsdpcheck.fingerprint_checkpoint(case.path)
    assert {k: fp.get(k) for k in case.model_keys} == case.extra["model_fingerprints"]
