"""A failed ``fsdpcheck.load`` leaves the model as it was, or names what it wrote.

Everything a load reads is checked before the first byte reaches the model (NOTE: [check before
writing] in ``fsdpcheck/sources/dcp/load.py``): storage transforms undone within their bound
(a decompression bomb is refused there), blobs located or loaded, regions and destinations
sized. The faults sit in the LAST entry read, so a load that wrote as it went would have
overwritten every other tensor first. What can still fail while writing (a file truncated by
another writer meanwhile) names the keys written. Across ranks:
tests/dist/failures/failure_scenarios.py (``load_refused_on_one_rank_writes_on_none``).
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpcheck
from fsdpcheck.sources.dcp import load as safe_reader
from fsdpcheck.testing import small_model


def _state(m: Any, opt: Any) -> dict[str, int]:
    """Every parameter and optimizer state tensor, fingerprinted (read-only)."""
    out = {k: fsdpcheck.fingerprint_tensor(v) for k, v in m.state_dict().items()}
    for p, st in opt.state.items():
        for name, v in st.items():
            out[f"{id(p)}.{name}"] = fsdpcheck.fingerprint_tensor(v)
    return out


def _saved(path: Path) -> Path:
    m, opt = small_model()
    fsdpcheck.save(m, path, optimizer=opt)
    return path


def _last_model_entry(ck: Path) -> tuple[str, Any]:
    """(key, storage info) of the model tensor whose bytes come last in its file."""
    md = pickle.loads((ck / ".metadata").read_bytes())
    idx, info = max(
        ((x, i) for x, i in md.storage_data.items() if x.fqn.startswith("model.")),
        key=lambda xi: xi[1].offset,
    )
    return idx.fqn, info


class _Bomb(io.RawIOBase):
    """Zeros without end: a stream.zstd entry of a few hundred bytes can inflate to gigabytes."""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        b[:] = bytes(len(b))
        return len(b)


@pytest.mark.parametrize("sentinel", [False, True])
def test_a_decompression_bomb_in_the_last_entry_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sentinel: bool
) -> None:
    from torch.distributed.checkpoint import filesystem

    ck = _saved(tmp_path / "ck")
    key, _ = _last_model_entry(ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            info.transform_descriptors = ["stream.zstd/1"]
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    monkeypatch.setattr(
        filesystem._StorageReaderTransforms,
        "transform_load_stream",
        lambda self, req, descriptors, stream: io.BufferedReader(_Bomb()),
    )
    m2, opt2 = small_model(seed=1)
    before = _state(m2, opt2)
    with pytest.raises(fsdpcheck.CheckpointError) as e:
        fsdpcheck.load(m2, ck, optimizer=opt2, sentinel=sentinel)
    assert _state(m2, opt2) == before  # no tensor written, no sentinel left behind
    numel = dict(m2.named_parameters())[key.removeprefix("model.")].numel()
    assert str(e.value) == (
        f"loading {ck} failed: the check before writing into the model failed: "
        f"{ck}/__0_0.distcp: {key}: its storage transform (stream.zstd/1) inflates past "
        f"{numel * 4 + safe_reader.RECORD_SLACK} bytes, more than the entry can hold; refusing "
        "it (a decompression bomb?); nothing was written into the model (it is as it was)"
    )


def test_a_blob_that_does_not_load_is_refused_before_any_write(tmp_path: Path) -> None:
    ck = _saved(tmp_path / "ck")
    key, info = _last_model_entry(ck)
    f = ck / info.relative_path
    data = bytearray(f.read_bytes())
    # Its zip records unreadable: neither located nor loadable (the length stays right).
    data[info.offset : info.offset + info.length] = b"\xff" * info.length
    f.write_bytes(bytes(data))
    m2, opt2 = small_model(seed=1)
    before = _state(m2, opt2)
    with pytest.raises(fsdpcheck.CheckpointError) as e:
        fsdpcheck.load(m2, ck, optimizer=opt2)
    assert _state(m2, opt2) == before
    text = str(e.value)
    assert text.startswith(
        f"loading {ck} failed: the check before writing into the model failed: {f}: {key}: "
        "cannot load the saved chunk: "
    ), text
    assert text.endswith("; nothing was written into the model (it is as it was)"), text


def test_a_file_truncated_while_the_load_writes_names_what_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = _saved(tmp_path / "ck")
    real = safe_reader.SafeFileSystemReader._read_item
    done: list[str] = []

    def truncating(self: Any, stream: Any, path: Path, req: Any, planner: Any) -> None:
        real(self, stream, path, req, planner)
        done.append(req.dest_index.fqn)
        if len(done) == 1:  # another writer cuts the file after the first region is written
            path.write_bytes(b"")

    monkeypatch.setattr(safe_reader.SafeFileSystemReader, "_read_item", truncating)
    m2, opt2 = small_model(seed=1)
    with pytest.raises(fsdpcheck.CheckpointError) as e:
        fsdpcheck.load(m2, ck, optimizer=opt2)
    text = str(e.value)
    f = ck / "__0_0.distcp"
    assert text.startswith(f"loading {ck} failed: on rank 0: {f}: "), text
    assert "could be read at byte " in text and f"({f} changed while it was read: it was " in text
    regions = 16  # 4 model tensors and 12 optimizer state tensors
    assert text.endswith(
        f"1 of the {regions} tensor regions this rank loads were written before it "
        f"({done[0]}), the rest were not; the model is partly overwritten; load again once the "
        "checkpoint is repaired"
    ), text


def test_a_later_part_refused_names_the_parts_loaded_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accelerate's layout: pytorch_model_fsdp_0/ loads whole, then optimizer_0/ is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, opt = small_model()
    msd, osd = get_state_dict(m, opt)
    d = tmp_path / "state"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd}, checkpoint_id=str(d / "pytorch_model_fsdp_0"), no_dist=True)
        dcp.save({"optimizer": osd}, checkpoint_id=str(d / "optimizer_0"), no_dist=True)
    omd = pickle.loads((d / "optimizer_0" / ".metadata").read_bytes())
    tensors = {k for k, v in omd.state_dict_metadata.items() if hasattr(v, "chunks")}
    _, info = max(
        ((x, i) for x, i in omd.storage_data.items() if x.fqn in tensors),
        key=lambda xi: xi[1].offset,
    )
    f = d / "optimizer_0" / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset : info.offset + info.length] = b"\xff" * info.length  # it no longer loads
    f.write_bytes(bytes(data))
    m2, opt2 = small_model(seed=1)
    before = _state(m2, opt2)
    with pytest.raises(fsdpcheck.CheckpointError) as e:
        fsdpcheck.load(m2, d, optimizer=opt2)
    text = str(e.value)
    assert text.startswith(f"loading {d / 'optimizer_0'} failed: "), text
    assert text.endswith(
        "; nothing of it was written into the model; loaded before it (so the model is partly "
        "overwritten): pytorch_model_fsdp_0 (4 keys: model.0.bias, model.0.weight, "
        "model.2.bias, model.2.weight); load again once the checkpoint is repaired"
    ), text
    after = _state(m2, opt2)
    model_keys = set(m2.state_dict())
    assert all(after[k] != before[k] for k in model_keys)  # the model part: loaded
    assert {k: v for k, v in after.items() if k not in model_keys} == {
        k: v for k, v in before.items() if k not in model_keys
    }  # the optimizer: as it was
    assert all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), m.state_dict().values()))
