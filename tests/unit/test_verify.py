"""fsdpcheck.verify in one process (no process group): keys, tolerances, reports, sources."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import fsdpcheck
from fsdpcheck import matching
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources.base import Entry, Region
from fsdpcheck.testing import small_model


def kinds(r: fsdpcheck.Report) -> list[tuple[str, str]]:
    return [(f.key, f.kind) for f in r.findings]


def test_clean_in_memory_and_report_api():
    m, _ = small_model()
    r = fsdpcheck.verify(m, {k: v.clone() for k, v in m.state_dict().items()})
    assert r.ok and r.findings == [] and r.keys_checked == 4 and r.elements_checked == 66
    r.raise_if_failed()  # no exception
    assert "OK" in str(r)
    json.dumps(r.to_dict())


def test_value_finding_text_and_raise():
    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref["2.weight"][1, 3] += 0.25
    r = fsdpcheck.verify(m, ref)
    (f,) = r.findings
    assert (f.key, f.kind, f.mismatched, f.numel, f.max_abs_index, f.rank) == (
        "2.weight",
        "value",
        1,
        21,
        (1, 3),
        0,
    )
    text = str(r)
    assert "Mismatched elements: 1 / 21 (4.8%)" in text
    assert "at index (1, 3) on rank 0 (up to 0.0 allowed)" in text
    with pytest.raises(fsdpcheck.VerificationError, match=r"2\.weight"):
        r.raise_if_failed()
    d = r.to_dict()
    assert d["ok"] is False and d["findings"][0]["max_abs_index"] == [1, 3]


def test_missing_and_unexpected_keys():
    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    del ref["0.bias"]
    ref["3.weight"] = torch.zeros(2)
    r = fsdpcheck.verify(m, ref)
    assert kinds(r) == [("0.bias", "missing"), ("3.weight", "unexpected")]
    assert r.keys_a == 4 and r.keys_b == 4 and r.keys_checked == 3
    assert "4 keys on live, 4 on checkpoint, 3 compared, 0 skipped" in r.summary()
    rows = {(row.a, row.b): row.status for row in r.mapping}
    assert rows[("0.bias", None)] == "missing" and rows[(None, "3.weight")] == "unexpected"
    # Excluded by the user: listed as ignored, and the verdict is OK.
    r = fsdpcheck.verify(m, ref, ignore=["0.bias", "3.*"])
    assert r.ok and r.keys_checked == 3 and len(r.skipped()) == 2


@pytest.mark.parametrize("prefix", ["model.", "module.", "_orig_mod.", "model.module."])
def test_checkpoint_prefix_detected(prefix):
    m, _ = small_model()
    ref = {prefix + k: v.clone() for k, v in m.state_dict().items()}
    r = fsdpcheck.verify(m, ref)
    assert r.ok, str(r)
    assert r.keys_checked == 4


def test_key_map_dict_and_callable():
    m, _ = small_model()
    ref = {"enc." + k: v.clone() for k, v in m.state_dict().items()}
    r = fsdpcheck.verify(m, ref, key_map=lambda k: "enc." + k)
    assert r.ok, str(r)
    mapping = {k: "enc." + k for k in m.state_dict()}
    mapping["2.bias"] = None  # not checked
    r2 = fsdpcheck.verify(m, ref, key_map=mapping)
    assert kinds(r2) == [("enc.2.bias", "unexpected")]


def test_dtype_difference_uses_default_tolerance_and_reports_dtype():
    m, _ = small_model()
    ref = {k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}
    r = fsdpcheck.verify(m, ref)
    assert {k for k, kind in kinds(r)} == set(m.state_dict())
    assert {kind for _, kind in kinds(r)} == {"dtype"}  # values agree within bf16 tolerance
    r2 = fsdpcheck.verify(m, ref, check_dtype=False)
    assert r2.ok
    r3 = fsdpcheck.verify(m, ref, check_dtype=False, rtol=0, atol=0)
    assert {kind for _, kind in kinds(r3)} == {"value"}  # exact when asked


def test_explicit_tolerance():
    m, _ = small_model()
    ref = {k: v * (1 + 1e-4) for k, v in m.state_dict().items()}
    assert not fsdpcheck.verify(m, ref).ok
    assert fsdpcheck.verify(m, ref, rtol=1e-3).ok
    r = fsdpcheck.verify(m, ref, atol=1e-9)
    assert r.findings[0].atol == 1e-9 and r.findings[0].rtol == 0.0


def test_shape_difference():
    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref["0.weight"] = torch.zeros(7, 6)
    r = fsdpcheck.verify(m, ref)
    assert kinds(r) == [("0.weight", "shape")]
    assert r.keys_checked == 3  # matched but not compared


def test_requires_grad_against_module_reference():
    m, _ = small_model()
    ref, _ = small_model()
    ref[0].bias.requires_grad_(False)
    r = fsdpcheck.verify(m, ref)
    assert kinds(r) == [("0.bias", "requires_grad")]


def test_optimizer_against_dcp_and_torch_save(tmp_path):
    m, opt = small_model()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    for ref in (tmp_path / "dcp", tmp_path / "full.pt"):
        r = fsdpcheck.verify(m, ref, optimizer=opt)
        assert r.ok, str(r)
        assert r.keys_checked == 4 + 4 * 3
    # A zeroed moment and a changed learning rate.
    opt.state[m[0].weight]["exp_avg"].zero_()
    opt.param_groups[0]["lr"] = 5e-3
    r = fsdpcheck.verify(m, tmp_path / "dcp", optimizer=opt)
    assert kinds(r) == [
        ("optim.param_groups.0.lr", "value"),
        ("optim.state.0.weight.exp_avg", "value"),
    ]
    assert "every element on the checked side is zero" in r.findings[1].message
    assert "0.005" in r.findings[0].message


def test_optimizer_state_missing_on_live_side(tmp_path):
    m, opt = small_model()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fresh = torch.optim.AdamW(m.parameters(), lr=1e-3)  # no state yet
    before = fsdpcheck.fingerprint(m)
    r = fsdpcheck.verify(m, tmp_path / "dcp", optimizer=fresh)
    # Read-only: torch would initialise an empty optimizer by stepping it; verify never does.
    assert not fresh.state and fsdpcheck.fingerprint(m) == before
    # ONE line for the empty optimizer, not one per checkpoint tensor; the rows name them all.
    (f,) = r.findings
    assert (f.key, f.kind) == ("optim.state", "missing")
    assert "the optimizer has no state" in f.message
    unchecked = [row for row in r.mapping if row.reason == "the optimizer holds no state"]
    assert len(unchecked) == 12 and all(row.status == "ignored" for row in unchecked)


def test_note_when_checkpoint_has_optimizer_state_not_asked_for(tmp_path):
    m, opt = small_model()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = fsdpcheck.verify(m, tmp_path / "dcp")
    assert r.ok and any("optimizer=" in n for n in r.notes)


def test_safetensors_sources(tmp_path):
    from safetensors.torch import save_file

    m, _ = small_model()
    save_file(
        {k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "m.safetensors")
    )
    src = open_source(tmp_path / "m.safetensors")
    assert src.kind == "safetensors"
    (box,) = src.read([Region("0.weight", (2, 1), (3, 2))], torch.device("cpu"))
    assert torch.equal(box, m.state_dict()["0.weight"][2:5, 1:3])
    assert fsdpcheck.verify(m, tmp_path).ok


def test_memory_budget_splits_reads():
    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref["0.weight"][6, 4] = 9.0
    r = fsdpcheck.verify(m, ref, memory_budget=20)  # one row (20 bytes) at a time
    (f,) = r.findings
    assert f.max_abs_index == (6, 4) and f.numel == 35


def test_bad_arguments():
    m, _ = small_model()
    with pytest.raises(ValueError, match="memory_budget"):
        fsdpcheck.verify(m, {}, memory_budget=0)
    with pytest.raises(ValueError, match="rtol"):
        fsdpcheck.verify(m, {}, rtol=-1)
    r = fsdpcheck.verify(m, 42)
    assert kinds(r) == [("*", "error")] and "reference must be" in r.findings[0].message
    r = fsdpcheck.verify("not a model", {})
    assert kinds(r) == [("*", "error")]


def test_nan_counts_in_message():
    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref["2.bias"][0] = float("nan")
    (f,) = fsdpcheck.verify(m, ref).findings
    assert "NaNs: 0 on the checked side, 1 in the reference" in f.message


def test_classify_flat_and_nested_keys():
    e = {
        "model.a.w": Entry("model.a.w", ("model.a.w",), (2,), torch.float32),
        "optim.state.a.w.exp_avg": Entry("optim.state.a.w.exp_avg", ("optim.state.a.w.exp_avg",)),
        "optimizer.param_groups.0.lr": Entry(
            "x", ("optimizer.param_groups.0.lr",), is_tensor=False
        ),
        "n": Entry("n", ("optimizer", "state", "3", "step"), (), torch.float32),
        "epoch": Entry("epoch", ("epoch",), is_tensor=False),
    }
    c = matching.keys_from_entries(e)
    # A flat key is one name, dots included: "model." of a flat key is never a container.
    assert list(c.model) == ["model.a.w"]
    assert set(c.state) == {("a.w", "exp_avg"), ("3", "step")}
    assert list(c.groups["0"]) == ["lr"]
    assert [r.key for r in c.other] == ["epoch"]


def test_out_of_memory_while_reading_is_a_finding():
    from fsdpcheck.sources.memory import MemorySource

    class Exhausted(MemorySource):
        def read(self, regions, device, out=None):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    m, _ = small_model()
    r = fsdpcheck.verify(m, Exhausted(m.state_dict()))
    assert {f.kind for f in r.findings} == {"error"}
    assert len(r.findings) == 4 and "out of memory" in r.findings[0].message


def test_a_failed_read_is_a_finding_and_the_batches_after_it_are_compared(tmp_path):
    from fsdpcheck.sources.dcp.source import DCPSource

    m, _ = small_model()
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    ref["2.weight"][1, 2] += 1.0  # in a batch read after the one that fails
    dcp.save(ref, checkpoint_id=tmp_path)

    class Flaky(DCPSource):
        def read(self, regions, device, out=None):
            if any(r.key == "0.bias" for r in regions):
                raise OSError(5, "Input/output error")
            return super().read(regions, device, out)

    # 16-byte batches: several batches per key, read ahead of the one compared.
    r = fsdpcheck.verify(m, Flaky(tmp_path), memory_budget=32)
    assert not r.ok
    assert sorted(kinds(r)) == [("0.bias", "error"), ("2.weight", "value")], r.findings
    err = next(f for f in r.findings if f.kind == "error")
    assert "reading the reference failed" in err.message and "Input/output" in err.message
    val = next(f for f in r.findings if f.kind == "value")
    assert val.max_abs_index == (1, 2) and val.mismatched == 1
    # The same reference without the failing reads: only the planted value.
    assert kinds(fsdpcheck.verify(m, tmp_path, memory_budget=32)) == [("2.weight", "value")]
