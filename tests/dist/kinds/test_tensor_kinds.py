"""Every tensor kind fsdpcheck cannot read as a dense array is one finding naming key and kind.

Sparse COO / CSR, quantized, meta, nested, an opaque wrapper subclass and a 9-d tensor whose dims
do not merge into the kernels' 8: on the live side (verify, fingerprint), as an in-memory
reference and in a torch.save file (compare, audit). The rest is still checked. A wrapper
subclass around one plain tensor (torchao's float8 weight wrapper) is read as that tensor.
The 2-rank scenario (tests/dist/kinds/kinds_scenarios.py) checks the same on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpcheck
from fsdpcheck._compat import dense_inner, tensor_kind_problem
from fsdpcheck.layout import local_layout, strides_problem
from tests.dist.kinds.kinds_scenarios import REGISTRY, Opaque, Wrapped, kinds
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.kinds.kinds_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)

# What each kind's finding must say (a substring), and the one word of its kind.
SAID = {
    "sparse_coo": "is a sparse_coo tensor: compare a dense copy (.to_dense())",
    "sparse_csr": "is a sparse_csr tensor: compare a dense copy (.to_dense())",
    "quantized": "is a quantized tensor (torch.qint8): its integers are not its values",
    "meta": "is a tensor on the meta device: it holds no data",
    "nested": "is a nested tensor (torch.nested)",
    "jagged": "is a nested tensor (torch.nested)",
    "opaque": "is an opaque tensor subclass (Opaque) that keeps its data its own way",
    "nine_d": "is a 9-d tensor (shape (3, 3, 3, 3, 3, 3, 3, 3, 3), strides (2, 6, 18, 54, 162, "
    "486, 1458, 4374, 13122)) whose dims merge into 9, more than the 8 the kernels index",
}
OFFLINE = [k for k in SAID if k != "quantized"]  # offline, quantized is an unsupported dtype


def _model(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    t = kinds()[name]
    good = torch.arange(6.0).reshape(2, 3)
    ref_t = torch.zeros(2) if name in ("nested", "jagged") else torch.zeros(tuple(t.shape))
    return {"good": good, "x": t}, {"good": good.clone(), "x": ref_t}


@pytest.mark.parametrize("name", list(SAID))
def test_live_kind_is_one_finding(name: str) -> None:
    live, ref = _model(name)
    r = fsdpcheck.verify(live, ref)
    assert [(f.key, f.kind) for f in r.findings] == [("x", "layout")], str(r)
    assert SAID[name] in r.findings[0].message
    assert r.keys_checked == 1  # the rest is still checked
    bad = dict(live, good=live["good"] + torch.tensor([[0.0, 0, 0], [0, 0, 1]]))
    r = fsdpcheck.verify(bad, ref)
    assert sorted((f.key, f.kind) for f in r.findings) == [("good", "value"), ("x", "layout")]
    with pytest.raises(fsdpcheck.FingerprintError, match="^x: it " + _re(SAID[name])):
        fsdpcheck.fingerprint(live)


@pytest.mark.parametrize("name", OFFLINE)
def test_in_memory_reference_kind_is_named(name: str) -> None:
    live, ref = _model(name)
    dense = {"good": live["good"], "x": ref["x"]}
    for a, b, side in ((live, dense, "actual"), (dense, live, "expected")):
        r = fsdpcheck.compare_checkpoints(a, b)
        assert [(f.key, f.kind) for f in r.findings] == [("x", "error")], str(r)
        assert r.findings[0].message.startswith(f"{side}: in-memory state dict: x ")
        assert SAID[name] in r.findings[0].message
        assert r.keys_checked == 1
    # As verify's reference: named, never read.
    r = fsdpcheck.verify(dense, live)
    assert [(f.key, f.kind) for f in r.findings] == [("x", "error")], str(r)


@pytest.mark.parametrize("name", [n for n in OFFLINE if n not in ("meta", "opaque", "jagged")])
def test_torch_save_file_kind_is_named(name: str, tmp_path: Path) -> None:
    live, ref = _model(name)
    path = tmp_path / "sd.pt"
    torch.save(live, path)
    r = fsdpcheck.audit(path)
    assert [(f.key, f.kind) for f in r.findings] == [("x", "error")], str(r)
    assert SAID[name] in r.findings[0].message
    r = fsdpcheck.compare_checkpoints(path, {"good": live["good"], "x": ref["x"]})
    assert [(f.key, f.kind) for f in r.findings] == [("x", "error")], str(r)
    assert r.keys_checked == 1


def test_quantized_offline_is_an_unsupported_dtype(tmp_path: Path) -> None:
    live, _ = _model("quantized")
    torch.save(live, tmp_path / "q.pt")
    r = fsdpcheck.compare_checkpoints(tmp_path / "q.pt", tmp_path / "q.pt")
    assert [(f.key, f.kind) for f in r.findings] == [("x", "skipped")], str(r)


def test_wrapper_around_one_tensor_is_read_as_it() -> None:
    inner = torch.arange(12.0).reshape(3, 4)
    w = Wrapped(inner)
    assert dense_inner(w) is inner and tensor_kind_problem(w) is None
    assert [p.tensor is inner for p in local_layout(w).pieces] == [True]
    r = fsdpcheck.verify({"w": w}, {"w": inner.clone()})
    assert r.ok, str(r)
    bad = inner.clone()
    bad[2, 1] += 1
    r = fsdpcheck.verify({"w": w}, {"w": bad})
    assert [(f.key, f.max_abs_index) for f in r.findings] == [("w", (2, 1))], str(r)
    assert fsdpcheck.fingerprint({"w": w}) == fsdpcheck.fingerprint({"w": inner})


def test_opaque_and_plain_kinds() -> None:
    assert dense_inner(Opaque((2,))) is None
    t = torch.ones(3)
    assert dense_inner(t) is t and tensor_kind_problem(t) is None
    assert tensor_kind_problem(torch.nn.Parameter(torch.ones(2))) is None


def test_strides_that_merge() -> None:
    # 9 and more dims are fine when they merge: contiguous, or sliced along the outermost dim.
    t = torch.arange(2.0**10).reshape([2] * 10)
    assert strides_problem(t) is None
    assert strides_problem(t[1]) is None
    assert strides_problem(t.transpose(0, 1)) is None  # 10 dims merge into 3
    assert strides_problem(t.permute(*range(9, -1, -1))) is not None
    # A box of a larger tensor: the global strides count too.
    piece = torch.arange(2.0**9).reshape([2] * 9)
    assert strides_problem(piece, (4,) * 9) is not None
    assert strides_problem(piece, (2,) * 8 + (4,)) is None


# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name))


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


@checks("every_kind")
def every_rank_names_each_kind_once(r: dict[str, Any]) -> None:
    bad = {f"bad.{n}" for n in SAID}
    assert sorted((k, kind, rank) for k, kind, rank, _ in r["findings"]) == sorted(
        (k, "layout", None) for k in bad
    )
    for key, _, _, message in r["findings"]:
        assert SAID[key.removeprefix("bad.")] in message, message
    assert r["checked"] == 3  # sharded, plain and the wrapper around a plain tensor
    assert sorted((k, kind) for k, kind, _ in r["planted"]) == sorted(
        [("plain", "value")] + [(k, "layout") for k in bad]
    )
    assert [i for k, _, i in r["planted"] if k == "plain"] == [[3]]
    assert r["fingerprint_error"] is not None
    assert all(k in r["fingerprint_error"] for k in bad)
    assert r["wrapped_fp"] == r["plain_fp"]


def _re(text: str) -> str:
    import re

    return re.escape(text)
