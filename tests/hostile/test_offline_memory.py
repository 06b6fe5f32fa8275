"""What bounds the per-key memory of compare, inspect and fingerprint, pinned by exact counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from fsdpcheck import cli
from fsdpcheck.comparison import _CompareJob, compare_checkpoints
from fsdpcheck.inspection import inspect_checkpoint
from fsdpcheck.keys import CkptKey
from fsdpcheck.names import WRAPPER_COMPONENTS, canonical_names
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources import Entry, prefetch
from fsdpcheck.sources.prefetch import MAX_REGIONS, batch_ranges
from fsdpcheck.tolerances import CheckSettings


# -- batches ----------------------------------------------------------------------------------
def test_batches_hold_at_most_the_cap_of_regions() -> None:
    sizes = [4] * (2 * MAX_REGIONS + 12)
    got = list(batch_ranges(sizes, range(7, len(sizes)), 1 << 20))
    assert [len(r) for r in got] == [MAX_REGIONS, MAX_REGIONS, 5]
    assert [i for r in got for i in r] == list(range(7, len(sizes)))


def test_batches_are_cut_by_bytes_too_and_a_large_item_is_alone() -> None:
    got = list(batch_ranges([3, 3, 3, 10, 1, 1], range(6), 6))
    assert got == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert list(batch_ranges([], range(0), 6)) == []


def _ten_tensors_and_a_planted_copy() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    a = {f"w{i}": torch.arange(6, dtype=torch.float32) + i for i in range(10)}
    b = {k: v.clone() for k, v in a.items()}
    b["w7"][2] += 1
    return a, b


def _regions_per_read(monkeypatch: pytest.MonkeyPatch, cap: int) -> list[int]:
    """Caps batches at `cap` regions; the list then receives each read's number of regions."""
    monkeypatch.setattr(prefetch, "MAX_REGIONS", cap)
    seen: list[int] = []
    read = prefetch._read

    def spy(source, regions, *args):  # type: ignore[no-untyped-def]
        seen.append(len(regions))
        return read(source, regions, *args)

    monkeypatch.setattr(prefetch, "_read", spy)
    return seen


def test_compare_reads_at_most_the_cap_of_regions_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _ten_tensors_and_a_planted_copy()
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    seen = _regions_per_read(monkeypatch, 3)
    report = compare_checkpoints(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert seen == [3, 3, 3, 3, 3, 3, 1, 1]  # 10 tensors per side, 3 at most per batch
    (f,) = report.findings
    assert (f.key, f.kind, f.mismatched, f.max_abs_index) == ("w7", "value", 1, (2,))


def test_verify_reads_at_most_the_cap_of_regions_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsdpcheck

    live, saved = _ten_tensors_and_a_planted_copy()
    save_file(saved, str(tmp_path / "m.safetensors"))
    seen = _regions_per_read(monkeypatch, 3)
    report = fsdpcheck.verify(live, tmp_path / "m.safetensors")
    assert seen == [3, 3, 3, 1]  # 10 pieces, 3 at most per batch
    (f,) = report.findings
    assert (f.key, f.kind, f.mismatched, f.max_abs_index) == ("w7", "value", 1, (2,))


# -- per-key structures -----------------------------------------------------------------------
def _reference_canonical(names: list[str]) -> dict[str, str]:
    parts = {n: [c for c in n.split(".") if c not in WRAPPER_COMPONENTS] for n in names}
    while parts:
        heads = {p[0] if len(p) > 1 else None for p in parts.values()}
        if len(heads) != 1 or next(iter(heads)) not in ("module", "_forward_module", "_orig_mod"):
            break
        parts = {n: p[1:] for n, p in parts.items()}
    return {n: ".".join(p) for n, p in parts.items()}


_COMPONENT = st.sampled_from(
    ["module", "_orig_mod", "_forward_module", "_fsdp_wrapped_module", "a", "0", "", "x_orig_mod"]
)


@given(st.lists(st.lists(_COMPONENT, min_size=1, max_size=5).map(".".join), max_size=6))
def test_canonical_names_as_the_component_lists_made_them(names: list[str]) -> None:
    assert canonical_names(names) == _reference_canonical(names)


def test_canonical_names_keep_the_strings_of_unchanged_names() -> None:
    names = ["".join(["layers.", "0.w"]), "layers.1.w"]
    out = canonical_names(names)
    assert all(out[n] is n for n in names)


def test_checkpoint_rows_are_four_slots_with_the_usual_fields() -> None:
    e = Entry("model.w", ("model", "w"), (2,), torch.float32)
    plain = CkptKey(e, "model", "w", raw="w")
    assert CkptKey.__slots__ == ("_rest", "entry", "name", "role")
    assert not hasattr(plain, "__dict__") and plain._rest is None
    assert (plain.fqn, plain.item, plain.optimizer, plain.raw, plain.container) == (
        "",
        "",
        0,
        "w",
        "",
    )
    state = CkptKey(e, "state", "optim.state.w.exp_avg", "w", "exp_avg", 1, "module.w", "optim")
    assert (state.fqn, state.item, state.optimizer, state.raw, state.container) == (
        "w", "exp_avg", 1, "module.w", "optim",
    )  # fmt: skip
    assert CkptKey(e, "other", "model.w").raw == ""
    assert state == CkptKey(e, "state", "optim.state.w.exp_avg", "w", "exp_avg", 1, "module.w",
                            "optim")  # fmt: skip
    assert len({plain, CkptKey(e, "model", "w", raw="w"), state}) == 2
    with pytest.raises(AttributeError, match="immutable"):
        plain.name = "x"  # type: ignore[misc]


def test_safetensors_source_keeps_entries_only_and_shares_names(tmp_path: Path) -> None:
    tensors = {f"layers.{i}.w": torch.full((2, 3), float(i)) for i in range(5)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file(tensors, str(tmp_path / "b.safetensors"))
    sa = open_source(tmp_path / "a.safetensors")
    sb = open_source(tmp_path / "b.safetensors")
    try:
        (h,) = sa._headers.values()  # type: ignore[attr-defined]
        assert (h.names, len(h.begin), len(h.end), h.shapes) == ([], 0, 0, [])
        assert {e.path for e in sa.entries().values()} == {()}
        assert not any(sb.entries()[k].key is k for k in sa.entries())
        sb.share_names(sa)
        assert all(sb.entries()[k].key is k for k in sa.entries())
        assert all(k is e.key for k, e in sb.entries().items())
        for src in (sa, sb):
            from fsdpcheck.sources import Region

            got = src.read([Region("layers.3.w", (1, 0), (1, 3))], torch.device("cpu"))
            assert torch.equal(got[0], torch.full((1, 3), 3.0))
    finally:
        sa.close()
        sb.close()


def test_the_compare_plan_is_columns_and_rows_are_made_for_the_report(tmp_path: Path) -> None:
    a = {f"w{i}": torch.ones(4) * i for i in range(4)} | {"only_a": torch.ones(1)}
    b = {f"w{i}": torch.ones(4) * i for i in range(4)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    sa, sb = open_source(tmp_path / "a.safetensors"), open_source(tmp_path / "b.safetensors")
    try:
        s = CheckSettings(None, None, True, True, None, None, 1 << 20)
        job = _CompareJob(sa, sb, s, torch.device("cpu"))
        assert job.pairs.names == ["w0", "w1", "w2", "w3"]
        assert (list(job.block_pair), list(job.block_bytes), job.cut) == (
            [0, 1, 2, 3],
            [32] * 4,
            {},
        )
        assert [(r.a, r.b, r.status) for r in job.rows] == [("only_a", None, "unexpected")]
        report = job.report(job.measure(range(4)), 0.0)
        assert [(r.a, r.b, r.status) for r in report.mapping] == [
            ("only_a", None, "unexpected"),
            *[(f"w{i}", f"w{i}", "compared") for i in range(4)],
        ]
        assert [(f.key, f.kind) for f in report.findings] == [("only_a", "unexpected")]
    finally:
        sa.close()
        sb.close()


# -- inspect, streamed ------------------------------------------------------------------------
@pytest.mark.parametrize("count", [0, 1, 3])
def test_inspect_json_printed_as_it_is_made_equals_the_dict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({f"b.{i}\nx": torch.zeros(i + 1) for i in range(count)}, str(path))
    assert cli.main(["inspect", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == json.dumps(inspect_checkpoint(path), indent=1) + "\n"
    assert len(json.loads(out)["tensors"]) == count
