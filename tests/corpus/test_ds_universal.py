"""DeepSpeed universal checkpoints (``ds_to_universal``) without DeepSpeed: the folder as written.

The folder is written here with torch.save in the converter's own format (DeepSpeed 0.19.8,
``ds_to_universal.py``); the one DeepSpeed itself writes from a ZeRO-2 engine is in the corpus
(tests/corpus/ds_universal.py, tests/corpus/test_corpus.py). Every file kind is read, or named as a
finding so the verdict is not OK: never a tensor left out silently.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import fsdpcheck
from fsdpcheck.formats import describe_path
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources.ds_universal import UniversalZeroSource

TAG = "global_step2_universal"
SHAPES = {"emb.weight": (5, 4), "head.weight": (3, 4), "head.bias": (3,)}
STATES = ("exp_avg", "exp_avg_sq", "fp32", "step")


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def write(root: Path, planted: dict[str, tuple[int, ...]] | None = None, **extra: object) -> Path:
    """A universal checkpoint of `SHAPES` under `root`; `planted`: key -> index bumped by 0.5."""
    folder = root / TAG
    zero = folder / "zero"
    params = _params()
    for fqn, p in params.items():
        d = zero / fqn
        d.mkdir(parents=True)
        values = {"fp32": p.clone(), "exp_avg": p * 0.1, "exp_avg_sq": p * p}
        for name, v in values.items():
            key = f"optim.state.{fqn}.{name}"
            if planted and key in planted:
                v[planted[key]] += 0.5
            torch.save({"param": v, "cat_dim": 0}, d / f"{name}.pt")
        torch.save(torch.tensor(2.0), d / "step.pt")
    torch.save({"param_groups": [{"lr": 0.1, "params": [0]}], "ds_version": "0.19.8"},
               zero / "optimizer_state.pt")  # fmt: skip
    module = {k: v.clone() for k, v in params.items()}
    if planted:
        for key, index in planted.items():
            if key in module:
                module[key][index] += 0.5
    torch.save({"module": module, "ds_version": "0.19.8", "mp_world_size": 1},
               folder / "mp_rank_00_model_states.pt")  # fmt: skip
    (root / "latest_universal").write_text(TAG)
    for rel, data in extra.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            (folder / rel).write_bytes(data)
        else:
            torch.save(data, folder / rel)
    return folder


def _names() -> list[str]:
    return sorted(list(SHAPES) + [f"optim.state.{f}.{n}" for f in SHAPES for n in STATES])


def test_recognised_and_read(tmp_path: Path) -> None:
    folder = write(tmp_path)
    for p in (folder, tmp_path):  # the folder, or the root whose latest_universal names it
        info = describe_path(p)
        assert info.layout == "deepspeed_universal"
        assert [q.name for q in info.paths] == ["mp_rank_00_model_states.pt", "zero"]
    r = fsdpcheck.audit(folder)
    assert r.ok, str(r)
    assert any("zero/optimizer_state.pt" in n and "not read" in n for n in r.notes)
    r = fsdpcheck.compare_checkpoints(folder, folder)
    n = len(_names())
    assert r.ok and (r.keys_a, r.keys_b, r.keys_checked) == (n, n, n), str(r)
    fps = fsdpcheck.fingerprint_checkpoint(folder)
    assert sorted(fps) == _names()
    # The values are the files': the fp32 master IS the tensor saved in fp32.pt.
    master = torch.load(folder / "zero/head.weight/fp32.pt", weights_only=True)["param"]
    assert fps["optim.state.head.weight.fp32"] == fsdpcheck.fingerprint_tensor(master)
    src = open_source(folder)
    try:
        zero = src.parts()[1]
        assert isinstance(zero, UniversalZeroSource)
        assert zero.cat_dim("emb.weight/fp32.pt") == 0
    finally:
        src.close()


def test_changed_master_and_moment_named_at_index(tmp_path: Path) -> None:
    clean = write(tmp_path / "a")
    planted = {"optim.state.head.weight.fp32": (2, 1), "optim.state.emb.weight.exp_avg_sq": (4, 3)}
    bad = write(tmp_path / "b", planted)
    # Before: the zero/ folder was not read at all, and this compared OK.
    r = fsdpcheck.compare_checkpoints(bad, clean)
    got = {(f.key, f.kind, f.max_abs_index) for f in r.findings}
    assert got == {(k, "value", i) for k, i in planted.items()}, str(r)
    a, b = fsdpcheck.fingerprint_checkpoint(bad), fsdpcheck.fingerprint_checkpoint(clean)
    assert {k for k in a if a[k] != b[k]} == set(planted)


def test_verify_live_model_against_module_weights(tmp_path: Path) -> None:
    folder = write(tmp_path)
    live = {k: v.clone() for k, v in _params().items()}
    r = fsdpcheck.verify(live, folder, ignore="optim.*")
    assert r.ok and r.keys_checked == len(SHAPES), str(r)
    live["head.bias"][1] += 1
    r = fsdpcheck.verify(live, folder, ignore="optim.*")
    assert [(f.key, f.max_abs_index) for f in r.findings] == [("head.bias", (1,))], str(r)


class _Boom:
    """Unpickling this would create a file: it must never happen."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.where),))


def _pickled(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("rel", "data", "said"),
    [
        ("zero/head.bias/notes.txt", b"hello", "is not a state file (<name>.pt) of the parameter"),
        ("zero/head.bias/exp_avg_sq.pt", b"not a zip", "cannot be read"),
        ("zero/head.bias/exp_avg.pt", {"cat_dim": 0}, "holds no 'param' tensor"),
        ("zero/head.bias/fp32.pt", {"param": torch.ones(3), "cat_dim": 1},
         "has cat_dim 1, not a dim of its 1-d 'param' (3,)"),
        ("zero/head.bias/fp32.pt", {"param": torch.ones(3), "scale": torch.ones(1)},
         "holds tensors besides 'param' (scale)"),
        ("zero/head.bias/fp32.pt", {"param": torch.ones(3), "layout": "interleaved"},
         "holds fields fsdpcheck does not know (layout)"),
        ("zero/stray.pt", b"x", "is not a parameter folder"),
        ("mp_rank_01_model_states.pt", {"module": {}},
         "holds another tensor-parallel rank's module weights"),
    ],
)  # fmt: skip
def test_what_is_not_read_is_named(tmp_path: Path, rel: str, data: object, said: str) -> None:
    folder = write(tmp_path, **{rel: data})
    r = fsdpcheck.audit(folder)
    assert not r.ok, str(r)
    assert any(said in f.message for f in r.findings), str(r)
    r = fsdpcheck.compare_checkpoints(folder, write(tmp_path / "clean"))
    assert not r.ok and any(said in f.message for f in r.findings), str(r)
    with pytest.raises(fsdpcheck.CheckpointError, match="refusing to fingerprint"):
        fsdpcheck.fingerprint_checkpoint(folder)


def test_no_code_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    evil = pickle.dumps(_Boom(str(canary)))
    folder = write(tmp_path / "ck", **{"zero/emb.weight/exp_avg.pt": _pickled(_Boom(str(canary)))})
    (folder / "zero/optimizer_state.pt").write_bytes(evil)  # never unpickled at all
    r = fsdpcheck.audit(folder)
    assert not canary.exists()
    assert not r.ok
    [refused] = [f for f in r.findings if f.kind == "error"]
    assert refused.key == "zero/emb.weight/exp_avg.pt", str(r)
    assert "cannot be read" in refused.message and "getattr" in refused.message
    fsdpcheck.compare_checkpoints(folder, folder)
    assert not canary.exists()


def test_root_with_both_latest_files_is_the_deepspeed_checkpoint(tmp_path: Path) -> None:
    write(tmp_path)
    (tmp_path / "global_step2").mkdir()
    torch.save({"module": _params()}, tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step2")
    # What DeepSpeed's load_checkpoint reads unless told to load the universal one.
    assert describe_path(tmp_path).layout == "deepspeed"
    assert describe_path(tmp_path / TAG).layout == "deepspeed_universal"


def test_latest_universal_naming_nothing(tmp_path: Path) -> None:
    (tmp_path / "latest_universal").write_text("../elsewhere")
    with pytest.raises(ValueError, match="does not name a checkpoint folder"):
        describe_path(tmp_path)
