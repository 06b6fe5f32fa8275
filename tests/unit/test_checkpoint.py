"""fingerprint / fingerprint_checkpoint / save / load / audit in one process."""

from __future__ import annotations

import itertools
import json
import pickle

import pytest
import torch

import fsdpcheck
from fsdpcheck.sources.tiling import tiling_problems
from fsdpcheck.testing import small_model
from tests import reference


def kinds(r: fsdpcheck.Report) -> list[tuple[str, str]]:
    return [(f.key, f.kind) for f in r.findings]


# ---------------------------------------------------------------------------------------------
def test_fingerprint_matches_definition_and_offline(tmp_path):
    m, opt = small_model()
    fps = fsdpcheck.fingerprint(m, optimizer=opt)
    assert fps["0.weight"] == reference.fingerprint(m[0].weight)
    assert fps["optim.state.0.weight.exp_avg"] == reference.fingerprint(
        opt.state[m[0].weight]["exp_avg"]
    )
    assert len(fps) == 4 + 4 * 3
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    assert fsdpcheck.fingerprint_checkpoint(tmp_path / "ck") == fps
    assert fsdpcheck.fingerprint_checkpoint(tmp_path / "ck", memory_budget=8) == fps
    torch.save({"model": m.state_dict()}, tmp_path / "full.pt")
    offline = fsdpcheck.fingerprint_checkpoint(tmp_path / "full.pt", memory_budget=16)
    assert offline == {k: v for k, v in fps.items() if not k.startswith("optim.")}


def test_fingerprint_sees_swaps_shifts_and_bits():
    m, _ = small_model()
    base = fsdpcheck.fingerprint(m)
    with torch.no_grad():
        w = m[0].weight
        w[[0, 1]] = w[[1, 0]]  # swapped rows
    assert {k for k, v in fsdpcheck.fingerprint(m).items() if v != base[k]} == {"0.weight"}
    with torch.no_grad():
        w[[0, 1]] = w[[1, 0]]
        m[2].bias.view(torch.int32)[1] ^= 1  # one flipped bit
    assert {k for k, v in fsdpcheck.fingerprint(m).items() if v != base[k]} == {"2.bias"}


def test_manifest_contents(tmp_path):
    m, opt = small_model()
    manifest = fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    on_disk = json.loads((tmp_path / "ck" / "fsdpcheck_manifest.json").read_text())
    assert on_disk == manifest.to_json()
    assert fsdpcheck.read_manifest(tmp_path / "ck") == manifest
    assert manifest.format_version == 1 and manifest.kind == "sharded"
    assert manifest.world_size == 1 and manifest.torch == torch.__version__
    e = manifest.entries["0.weight"]
    assert e.shape == (7, 5) and e.dtype == "float32"
    assert e.checkpoint_key == "model.0.weight"
    assert e.fingerprint == reference.fingerprint(m[0].weight)
    assert on_disk["entries"]["0.weight"]["fingerprint"] == f"{e.fingerprint:#018x}"
    assert manifest.entries["optim.state.2.bias.step"].checkpoint_key == ("optim.state.2.bias.step")
    # Nothing but the checkpoint is left beside it (the save went through a temporary sibling).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_save_then_load_with_fingerprint_verification(tmp_path):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    m2, opt2 = small_model(seed=1)
    r = fsdpcheck.load(m2, tmp_path / "ck", optimizer=opt2)
    assert r.ok, str(r)
    assert torch.equal(m2[0].weight, m[0].weight)
    assert any("sharded" in n for n in r.notes)
    assert fsdpcheck.fingerprint(m2, optimizer=opt2) == fsdpcheck.fingerprint(m, optimizer=opt)


def test_corrupted_distcp_file_caught_by_fingerprint_load(tmp_path):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    f = next((tmp_path / "ck").glob("*.distcp"))
    data = bytearray(f.read_bytes())
    # Flip one byte inside the raw data of the first tensor (0.weight: 35 float32 values).
    needle = m[0].weight.detach().contiguous().numpy().tobytes()[:16]
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 5] ^= 0x40
    f.write_bytes(bytes(data))
    m2, opt2 = small_model(seed=1)
    r = fsdpcheck.load(m2, tmp_path / "ck", optimizer=opt2)
    assert kinds(r) == [("0.weight", "value")], str(r)
    assert "fingerprint" in r.findings[0].message
    full = fsdpcheck.load(m2, tmp_path / "ck", optimizer=opt2, verify="full")
    assert full.ok  # the files agree with what was loaded; the manifest is what tells


def test_load_without_manifest_falls_back_to_full(tmp_path):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    (tmp_path / "ck" / "fsdpcheck_manifest.json").unlink()
    m2, opt2 = small_model(seed=1)
    r = fsdpcheck.load(m2, tmp_path / "ck", optimizer=opt2)
    assert r.ok and any("fell back" in n for n in r.notes)
    assert r.keys_checked == 16


def test_full_checkpoint_loads_and_expect_refuses(tmp_path):
    m, opt = small_model()
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    m2, opt2 = small_model(seed=1)
    with pytest.raises(fsdpcheck.CheckpointKindError, match=r"expected a sharded .* full"):
        fsdpcheck.load(m2, tmp_path / "full.pt", optimizer=opt2, expect="sharded")
    assert not torch.equal(m2[0].weight, m[0].weight)  # nothing was loaded
    r = fsdpcheck.load(m2, tmp_path / "full.pt", optimizer=opt2, expect="full")
    assert r.ok, str(r)
    assert torch.equal(m2[0].weight, m[0].weight)
    assert torch.equal(opt2.state[m2[0].weight]["exp_avg"], opt.state[m[0].weight]["exp_avg"])
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    with pytest.raises(fsdpcheck.CheckpointKindError, match=r"expected a full .* sharded"):
        fsdpcheck.load(m2, tmp_path / "ck", expect="full")


def test_sentinel_counts_elements_the_load_never_wrote(tmp_path):
    m, _ = small_model()
    sd = {k: v for k, v in m.state_dict().items() if k != "2.bias"}
    torch.save(sd, tmp_path / "partial.pt")
    m2, _ = small_model(seed=1)
    r = fsdpcheck.load(m2, tmp_path / "partial.pt", sentinel=True, verify=None)
    # The pairing names the key the checkpoint lacks; the sentinel counts what stayed unwritten.
    assert kinds(r) == [("2.bias", "missing"), ("2.bias", "missing")]
    by_count = {f.mismatched: f.message for f in r.findings}
    assert "not in the checkpoint" in by_count[0]
    assert "3 element(s) were never written" in by_count[3]


def test_bad_load_arguments(tmp_path):
    m, _ = small_model()
    with pytest.raises(ValueError, match="verify"):
        fsdpcheck.load(m, tmp_path, verify="fast")
    with pytest.raises(ValueError, match="expect"):
        fsdpcheck.load(m, tmp_path, expect="half")
    with pytest.raises(FileNotFoundError):
        fsdpcheck.load(m, tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
def test_tiling_problems():
    assert tiling_problems((10,), [((0,), (3,)), ((3,), (7,))]) == []
    assert tiling_problems((10,), [((0,), (3,)), ((4,), (6,))]) == ["gap at [3:4]"]
    assert tiling_problems((10,), [((0,), (5,)), ((3,), (7,))]) == ["overlap at [3:5]"]
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert tiling_problems((4, 6), grid) == []
    assert tiling_problems((4, 6), grid[:3]) == ["gap at [2:4, 3:6]"]
    assert tiling_problems((4, 6), [*grid[:3], ((1, 3), (3, 3))]) == ["overlap at [1:2, 3:6]"]
    assert tiling_problems((), [((), ())]) == []
    assert tiling_problems((), []) == ["the scalar is saved 0 times"]
    # A big uneven grid: fast (a sweep, not pairwise).
    rows = [0, *sorted({i * 7 for i in range(1, 300)}), 2100]
    cols = [0, *sorted({i * 5 for i in range(1, 40)}), 200]
    boxes = [
        ((r0, c0), (r1 - r0, c1 - c0))
        for r0, r1 in itertools.pairwise(rows)
        for c0, c1 in itertools.pairwise(cols)
    ]
    assert tiling_problems((2100, 200), boxes) == []


def _dcp(tmp_path, name="ck"):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / name, optimizer=opt)
    return tmp_path / name


def _edit_metadata(path, edit):
    f = path / ".metadata"
    md = pickle.loads(f.read_bytes())
    edit(md)
    f.write_bytes(pickle.dumps(md))


def test_audit_good_checkpoint(tmp_path):
    r = fsdpcheck.audit(_dcp(tmp_path))
    assert r.ok, str(r)
    assert r.keys_checked == 16
    assert fsdpcheck.audit(_dcp(tmp_path, "ck2"), deep=True).ok


def test_audit_removed_chunk(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    p = _dcp(tmp_path)

    def edit(md):
        meta = md.state_dict_metadata["model.0.weight"]
        meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 5]))]

    _edit_metadata(p, edit)
    r = fsdpcheck.audit(p)
    assert kinds(r) == [("model.0.weight", "gap")]
    assert "gap at [4:7]" in r.findings[0].message


def test_audit_overlapping_chunk(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    p = _dcp(tmp_path)

    def edit(md):
        meta = md.state_dict_metadata["model.0.weight"]
        meta.chunks = [
            *meta.chunks,
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 5])),
        ]

    _edit_metadata(p, edit)
    r = fsdpcheck.audit(p)
    assert ("model.0.weight", "layout") in kinds(r)
    assert any("overlap at [2:4" in f.message for f in r.findings)


def test_audit_truncated_and_missing_files(tmp_path):
    p = _dcp(tmp_path)
    f = next(p.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:200])
    r = fsdpcheck.audit(p)
    assert r.findings and all(x.kind == "error" for x in r.findings)
    assert "truncated" in r.findings[-1].message
    f.unlink()
    r = fsdpcheck.audit(p)
    assert r.findings and "does not exist" in r.findings[0].message


def test_audit_manifest_mismatch_and_optimizer_completeness(tmp_path):
    p = _dcp(tmp_path)
    mf = p / "fsdpcheck_manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["entries"]["0.weight"]["shape"] = [7, 6]
    mf.write_text(json.dumps(manifest))

    def edit(md):
        del md.state_dict_metadata["optim.state.2.bias.step"]

    _edit_metadata(p, edit)
    r = fsdpcheck.audit(p)
    got = kinds(r)
    assert ("0.weight", "shape") in got
    assert ("optim.state.2.bias.step", "missing") in got  # lacks what the others have


def test_audit_files(tmp_path):
    m, _ = small_model()
    torch.save(m.state_dict(), tmp_path / "m.pt")
    assert fsdpcheck.audit(tmp_path / "m.pt").ok
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    r = fsdpcheck.audit(tmp_path / "bad.pt")
    assert kinds(r) == [("*", "error")]
    # Unreadable input is an error to raise (the CLI's exit 2), not a finding.
    with pytest.raises(FileNotFoundError):
        fsdpcheck.audit(tmp_path / "missing")


@pytest.mark.parametrize("layout", ["optimizer-container", "flat-model"])
def test_load_follows_the_checkpoints_nesting(tmp_path, layout):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, opt = small_model()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optimizer": osd} if layout == "optimizer-container" else dict(msd)
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    m2, opt2 = small_model(seed=1)
    with_opt = opt2 if layout == "optimizer-container" else None
    r = fsdpcheck.load(m2, tmp_path / "ck", optimizer=with_opt)
    assert r.ok, str(r)
    assert torch.equal(m2[2].weight, m[2].weight)
    if with_opt is not None:
        assert torch.equal(opt2.state[m2[0].bias]["exp_avg"], opt.state[m[0].bias]["exp_avg"])


# ---------------------------------------------------------------------------------------------
# A refused load leaves the model untouched; save is atomic.
def _state_fingerprints(m, opt) -> dict[str, int]:
    """Every parameter and optimizer state tensor, fingerprinted (read-only)."""
    out = {k: fsdpcheck.fingerprint_tensor(v) for k, v in m.state_dict().items()}
    for p, st in opt.state.items():
        for name, v in st.items():
            out[f"{id(p)}.{name}"] = fsdpcheck.fingerprint_tensor(v)
    return out


def _damage_truncate(ck):
    f = sorted(ck.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _damage_delete(ck):
    sorted(ck.glob("*.distcp"))[0].unlink()


def _damage_manifest(ck):
    mf = ck / "fsdpcheck_manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["entries"]["0.weight"]["shape"] = "seven by five"
    mf.write_text(json.dumps(manifest))


def _damage_metadata_gap(ck):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpcheck.sources.dcp.load import read_dcp_metadata

    md = read_dcp_metadata(ck, dcp_classes=True)  # DCP's classes: written back for DCP
    meta = md.state_dict_metadata["model.0.weight"]
    assert isinstance(meta, TensorStorageMetadata)
    chunk = meta.chunks[0]
    meta.chunks[0] = type(chunk)(offsets=chunk.offsets, sizes=torch.Size([3, *chunk.sizes[1:]]))
    (ck / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        (_damage_truncate, fsdpcheck.CheckpointError, "bytes"),
        (_damage_delete, fsdpcheck.CheckpointError, "distcp"),
        (_damage_manifest, fsdpcheck.ManifestError, "shape"),
        (_damage_metadata_gap, fsdpcheck.CheckpointError, "gap"),
    ],
)
def test_refused_load_leaves_model_and_optimizer_untouched(tmp_path, damage, error, match):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    damage(tmp_path / "ck")
    m2, opt2 = small_model(seed=1)
    before = _state_fingerprints(m2, opt2)
    with pytest.raises(error, match=match) as e:
        fsdpcheck.load(m2, tmp_path / "ck", optimizer=opt2, sentinel=True)
    assert "\n" not in str(e.value)  # one line
    assert _state_fingerprints(m2, opt2) == before


def test_save_refuses_a_non_empty_target_and_overwrite_replaces_it_whole(tmp_path):
    m, opt = small_model()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "__7_0.distcp").write_bytes(b"stale shard of an older, larger save")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fsdpcheck.save(m, ck, optimizer=opt)
    assert (ck / "__7_0.distcp").exists() and not (ck / ".metadata").exists()
    fsdpcheck.save(m, ck, optimizer=opt, overwrite=True)
    assert not (ck / "__7_0.distcp").exists()  # nothing of the old generation survives
    assert fsdpcheck.audit(ck, deep=True).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_save_that_fails_half_way_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    m, opt = small_model()
    ck = tmp_path / "ck"
    fsdpcheck.save(m, ck, optimizer=opt)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    real_save = dcp.save

    def dies_half_way(state, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        fsdpcheck.save(m, ck, optimizer=opt, overwrite=True)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no half-written sibling


def test_save_refuses_an_optimizer_without_state(tmp_path):
    m, _ = small_model()
    fresh = torch.optim.AdamW(m.parameters())
    before = fsdpcheck.fingerprint(m)
    with pytest.raises(ValueError, match="no state"):
        fsdpcheck.save(m, tmp_path / "ck", optimizer=fresh)
    assert not fresh.state and fsdpcheck.fingerprint(m) == before
    assert not (tmp_path / "ck").exists()


def test_a_gap_is_a_gap_finding_in_verify_and_compare_never_data(tmp_path):
    m, opt = small_model()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    fsdpcheck.save(m, tmp_path / "good", optimizer=opt)
    _damage_metadata_gap(tmp_path / "ck")  # rows 3:7 of 0.weight are saved by no chunk
    r = fsdpcheck.verify(m, tmp_path / "ck", optimizer=opt)
    assert kinds(r) == [("0.weight", "gap")], str(r)
    assert "3:7" in r.findings[0].message
    r = fsdpcheck.compare_checkpoints(tmp_path / "ck", tmp_path / "good")
    assert kinds(r) == [("0.weight", "gap")], str(r)
    assert [row.status for row in r.mapping if row.a == "0.weight"] == ["skipped"]


# ---------------------------------------------------------------------------------------------
def _resave_with_dcp(path, seed):
    """A plain dcp.save of another state into a folder fsdpcheck.save wrote (its manifest stays)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, opt = small_model(seed=seed)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
    return m, opt


def test_a_manifest_of_an_earlier_save_is_called_stale_not_a_mismatch(tmp_path):
    from fsdpcheck.manifest import MANIFEST_NAME

    ck = _dcp(tmp_path)
    old_id = fsdpcheck.read_manifest(ck).saves["."].save_id
    m1, opt1 = _resave_with_dcp(ck, seed=1)
    r = fsdpcheck.audit(ck, deep=True)
    assert kinds(r) == [(MANIFEST_NAME, "error")], str(r)
    assert r.findings[0].message.startswith("the manifest is stale: it was written for an earlier")
    assert old_id in r.findings[0].message
    # load sets it aside (a note), checks against the files instead, and finds them right.
    m2, opt2 = small_model(seed=2)
    r = fsdpcheck.load(m2, ck, optimizer=opt2)
    assert r.ok, str(r)
    assert any(n.startswith("the manifest is stale") for n in r.notes)
    assert any("fell back to verify='full'" in n for n in r.notes)
    assert fsdpcheck.fingerprint(m2, optimizer=opt2) == fsdpcheck.fingerprint(m1, optimizer=opt1)


def test_the_staleness_check_reuses_the_digest_of_the_metadata_it_read(tmp_path, monkeypatch):
    """audit and load hash ``.metadata`` once (when they parse it), not again for the manifest."""
    from fsdpcheck import saving

    ck = _dcp(tmp_path)
    hashed: list[str] = []
    real = saving.sha256_of
    monkeypatch.setattr(saving, "sha256_of", lambda p: hashed.append(str(p)) or real(p))
    assert fsdpcheck.audit(ck, deep=True).ok
    m, opt = small_model(seed=3)
    assert fsdpcheck.load(m, ck, optimizer=opt).ok
    assert hashed == []
    _resave_with_dcp(ck, seed=1)  # a later save: the digest differs and the save id is read
    r = fsdpcheck.audit(ck)
    assert r.findings[0].message.startswith("the manifest is stale"), str(r)
    assert hashed == []


def test_a_damaged_metadata_is_not_called_stale(tmp_path):
    ck = _dcp(tmp_path)
    _damage_metadata_gap(ck)  # .metadata rewritten, same save id
    r = fsdpcheck.audit(ck)
    assert kinds(r) == [("model.0.weight", "gap")], str(r)


def test_audit_deep_on_a_manifest_without_fingerprints_says_so(tmp_path):
    from fsdpcheck.manifest import MANIFEST_NAME

    ck = _dcp(tmp_path)
    mf = ck / MANIFEST_NAME
    doc = json.loads(mf.read_text())
    for e in doc["entries"].values():
        e["fingerprint"] = None
    mf.write_text(json.dumps(doc))
    assert fsdpcheck.audit(ck).ok  # the structure alone is fine
    r = fsdpcheck.audit(ck, deep=True)
    assert kinds(r) == [(MANIFEST_NAME, "skipped")]
    assert r.findings[0].message == (
        "the manifest holds no fingerprints: --deep checked no value (only the structure was "
        "checked); save the checkpoint with fsdpcheck.save to have them"
    )
    doc["entries"]["0.weight"]["fingerprint"] = (
        f"{fsdpcheck.fingerprint(small_model()[0])['0.weight']:#018x}"
    )
    mf.write_text(json.dumps(doc))
    r = fsdpcheck.audit(ck, deep=True)
    assert r.ok and "ck: 15 manifest entries have no fingerprint" in r.notes[0], r.notes
    # The verdict says what --deep checked: one tensor's values, the others' not.
    assert r.reference.endswith(
        "and the values of 1 tensor(s) against the manifest's fingerprints (15 without one: "
        "not checked)"
    ), r.reference


def test_a_deeply_nested_manifest_is_one_line(tmp_path):
    from fsdpcheck.manifest import MANIFEST_NAME

    ck = _dcp(tmp_path)
    (ck / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    r = fsdpcheck.audit(ck)
    assert kinds(r) == [(MANIFEST_NAME, "error")]
    assert r.findings[0].message.endswith("is nested deeper than any manifest (not a manifest)")
    with pytest.raises(fsdpcheck.ManifestError, match="nested deeper"):
        fsdpcheck.load(small_model()[0], ck)


@pytest.mark.parametrize(
    ("shape", "offset", "bad"),
    [((4, 3), (1.5, 0), "float 1.5"), ((4, 3), (1.0, 0), "float 1.0"),
     ((4, 3), (True, 0), "bool True"), ((4.0, 3), None, "float 4.0"),
     ((4, 3), ("1", 0), "str '1'")],
)  # fmt: skip
def test_box_refuses_what_is_not_an_integer(shape, offset, bad):
    import numpy as np

    with pytest.raises(TypeError, match=f"must be a sequence of ints, got {bad}"):
        fsdpcheck.Box(shape, offset)
    b = fsdpcheck.Box(torch.Size([4, 3]), (np.int64(1), torch.tensor(2)))
    assert b.offset == (1, 2) and all(type(o) is int for o in b.offset)


def test_describe_error_names_the_root_cause_never_a_repr():
    import traceback as tb

    from torch.distributed.checkpoint.api import CheckpointException

    from fsdpcheck.report import describe_error

    inner = OSError(28, "No space left on device", "/ck/__0_0.distcp")
    wrapped = CheckpointException("boom", {1: (inner, tb.StackSummary()), 3: (ValueError(), None)})
    assert describe_error(wrapped) == "/ck/__0_0.distcp: No space left on device"
    # torch's zip writer reports a full disk as a position mismatch; the OSError is its context.
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from None
    except RuntimeError as suppressed:
        assert describe_error(suppressed).startswith("RuntimeError: [enforce fail")
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904
    except RuntimeError as swallowed:
        assert describe_error(swallowed) == "No space left on device"
    text = describe_error(ValueError("a\nb\x1b[31m"))
    assert text == "a\\nb\\x1b[31m"


def test_a_failed_dcp_read_inside_load_names_the_file_and_key(tmp_path):
    ck = _dcp(tmp_path)
    f = next(ck.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[:4] = b"XXXX"  # the first saved blob no longer unpickles
    f.write_bytes(bytes(data))
    m2, opt2 = small_model(seed=1)
    with pytest.raises(fsdpcheck.CheckpointError) as e:
        fsdpcheck.load(m2, ck, optimizer=opt2)
    text = str(e.value)
    assert "\n" not in text and "FrameSummary" not in text and "Traceback" not in text
    # Read while pairing (agreed on by every rank), before any byte reaches the model.
    assert text.startswith(f"pairing {ck} with the model failed: ")
    assert f"{f}: optim.param_groups." in text and "lr cannot be loaded weights_only" in text
