"""Fuzzing every reader's input: no code runs, nothing hangs, no false "equal".

Each example copies a pristine checkpoint, mutates one input (truncate, flip bytes, delete,
swap in a hostile pickle, mangle JSON, mangle the DCP metadata structures) and runs
``fingerprint_checkpoint`` and ``audit`` under a watchdog. Allowed outcomes: an exception of an
unreadable-input type (ValueError, OSError) with a one-line message, or a result. A result whose
fingerprints all equal the pristine ones must come from data that an independent reader (torch
itself, on non-hostile mutations) also finds bit-identical to the pristine data. Key names
full of control, format and bidi characters go through every command of the command line: each
printed line is printable, and no key adds a verdict or a finding line.

Deterministic in CI (``derandomize``); ``FSDPCHECK_FUZZ_EXAMPLES=N`` runs N examples per input.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdpcheck
from tests import examples
from tests.fuzz_cases import Planted, bounded, save_dcp, tiny_state

EXAMPLES = int(os.environ.get("FSDPCHECK_FUZZ_EXAMPLES", examples(15)))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="FSDPCHECK_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
WATCHDOG_S = 30.0


# ---------------------------------------------------------------------------------------------
def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape
        and a[k].dtype == b[k].dtype
        and torch.equal(_bits(a[k]), _bits(b[k]))
        for k in a
    )


def _torch_reads_dcp(path: Path) -> dict[str, torch.Tensor]:
    """torch's own reading of a DCP directory (only ever run on non-hostile mutations)."""
    import torch.distributed.checkpoint as dcp

    state = tiny_state(seed=99)
    del state["optim"]["param_groups"]  # tensors only: fingerprints speak of tensors only
    for t in _flat_tensors(state).values():
        t.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return _flat_tensors(state)


def _torch_reads_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if not index.exists():  # a folder of shards: every tensor of every file (none twice)
        out: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            part = load_file(str(f))
            assert not out.keys() & part.keys()
            out.update(part)
        return out
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for key, name in weight_map.items():
        out[key] = load_file(str(path / name))[key]
    return out


def _torch_reads_torch_save(path: Path) -> dict[str, torch.Tensor]:
    # Loaded as fsdpcheck documents it loads (mapped, CPU): the reference for the tensors' bytes.
    return _flat_tensors(torch.load(path / "model.pt", map_location="cpu", mmap=True,
                                    weights_only=True))  # fmt: skip


class Pristine:
    """One pristine checkpoint of each format and what fsdpcheck says about it."""

    def __init__(self, root: Path) -> None:
        from safetensors.torch import save_file

        self.root = root
        state = tiny_state()
        self.dirs = {"dcp": save_dcp(root / "dcp")}
        st_dir = root / "safetensors"
        st_dir.mkdir()
        model = state["model"]
        save_file({"0.weight": model["0.weight"]}, str(st_dir / "a.safetensors"))
        save_file({k: model[k] for k in ("0.bias", "2.weight")}, str(st_dir / "b.safetensors"))
        weight_map = {"0.weight": "a.safetensors", "0.bias": "b.safetensors",
                      "2.weight": "b.safetensors"}  # fmt: skip
        index = {"metadata": {}, "weight_map": weight_map}
        (st_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        self.dirs["safetensors"] = st_dir
        ts_dir = root / "torch_save"
        ts_dir.mkdir()
        torch.save(state, ts_dir / "model.pt")
        self.dirs["torch_save"] = ts_dir
        self.readers = {"dcp": _torch_reads_dcp, "safetensors": _torch_reads_safetensors,
                        "torch_save": _torch_reads_torch_save}  # fmt: skip
        self.data = {fmt: self.readers[fmt](d) for fmt, d in self.dirs.items()}
        self.fingerprints = {fmt: fsdpcheck.fingerprint_checkpoint(self.target(fmt, d))
                             for fmt, d in self.dirs.items()}  # fmt: skip

    @staticmethod
    def target(fmt: str, d: Path) -> Path:
        return d / "model.pt" if fmt == "torch_save" else d


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    return Pristine(tmp_path_factory.mktemp("pristine"))


# ---------------------------------------------------------------------------------------------
# Mutations. Each takes the copied checkpoint directory, the canary path and hypothesis data;
# it returns True when the mutation planted a hostile payload (torch's own reader must then not
# be used as the independent reference).
def _pick(data: st.DataObject, files: list[Path]) -> Path:
    return data.draw(st.sampled_from(sorted(files)), label="file")


def _truncate(f: Path, data: st.DataObject) -> None:
    raw = f.read_bytes()
    f.write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)), label="keep")])


def _flip(f: Path, data: st.DataObject) -> None:
    raw = bytearray(f.read_bytes())
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    f.write_bytes(bytes(raw))


def _json_value() -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
        | st.sampled_from(["../x.safetensors", "/etc/passwd", "a.safetensors", "", "F32", "U32"]),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=6,
    )  # fmt: skip


def _mangle_json(doc: Any, data: st.DataObject) -> Any:
    """Replaces one value somewhere in a JSON document by a random one."""
    if isinstance(doc, dict) and doc and data.draw(st.booleans(), label="descend"):
        k = data.draw(st.sampled_from(sorted(doc, key=str)), label="key")
        return {**doc, k: _mangle_json(doc[k], data)}
    if isinstance(doc, list) and doc and data.draw(st.booleans(), label="descend"):
        i = data.draw(st.integers(0, len(doc) - 1), label="index")
        return [*doc[:i], _mangle_json(doc[i], data), *doc[i + 1 :]]
    return data.draw(_json_value(), label="value")


def _mangle_safetensors_header(f: Path, data: st.DataObject) -> None:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = _mangle_json(json.loads(raw[8 : 8 + n]), data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


_METADATA_FIELDS = ("size", "chunk_offsets", "chunk_sizes", "drop_chunk", "dtype", "path",
                    "offset", "length", "planner_data", "drop_storage", "state_dict")  # fmt: skip


def _mangle_metadata(f: Path, data: st.DataObject) -> None:
    """Edits DCP's metadata objects (a trusted test-side unpickle of the pristine file)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = pickle.loads(f.read_bytes())
    what = data.draw(st.sampled_from(_METADATA_FIELDS), label="field")
    tensors = sorted(
        k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    )
    key = data.draw(st.sampled_from(tensors), label="key")
    meta = md.state_dict_metadata[key]
    ints = st.integers(-3, 2**62) | st.sampled_from([0, 1, 2, 3, 7])
    idx = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[idx]
    if what == "size":
        meta.size = torch.Size(data.draw(st.lists(ints, max_size=3), label="v"))
    elif what in ("chunk_offsets", "chunk_sizes") and meta.chunks:
        c = meta.chunks[0]
        v = data.draw(st.lists(ints, min_size=len(c.sizes), max_size=len(c.sizes)), label="v")
        setattr(c, "offsets" if what == "chunk_offsets" else "sizes", torch.Size(v))
    elif what == "drop_chunk":
        meta.chunks = meta.chunks[1:]
    elif what == "dtype":
        odd = [torch.float16, torch.int64, torch.uint32, torch.complex64, "float32", None]
        meta.properties.dtype = data.draw(st.sampled_from(odd), label="dtype")
    elif what == "path":
        info.relative_path = data.draw(st.sampled_from(["../x.distcp", "/etc/passwd", "", ".",
                                                        "nope.distcp", ".metadata"]))  # fmt: skip
    elif what in ("offset", "length"):
        setattr(info, what, data.draw(ints, label="v"))
    elif what == "planner_data":
        md.planner_data = data.draw(st.sampled_from([None, 3, "x", {key: 5}, {key: ("a", 1)}]))
    elif what == "drop_storage":
        del md.storage_data[idx]
    else:
        md.state_dict_metadata = data.draw(st.sampled_from([None, [], {1: meta}, {key: 3}]))
    f.write_bytes(pickle.dumps(md))


def _hostile_zip_member(f: Path, canary: Path) -> None:
    """Replaces a torch.save zip's ``data.pkl`` by a hostile pickle."""
    with zipfile.ZipFile(f) as z:
        members = {n: z.read(n) for n in z.namelist()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for n, b in members.items():
            z.writestr(n, pickle.dumps(Planted(canary)) if n.endswith("data.pkl") else b)
    f.write_bytes(buf.getvalue())


def mutate(fmt: str, d: Path, canary: Path, data: st.DataObject) -> bool:
    """Applies one drawn mutation to the checkpoint in `d`; True when it is hostile."""
    if fmt == "dcp":
        files = [d / ".metadata", *d.glob("*.distcp")]
        ops = ["truncate", "flip", "delete", "hostile", "structure"]
    elif fmt == "safetensors":
        files = [*d.glob("*.safetensors"), d / "model.safetensors.index.json"]
        ops = ["truncate", "flip", "delete", "json"]
    else:
        files = [d / "model.pt"]
        ops = ["truncate", "flip", "hostile"]
    op = data.draw(st.sampled_from(ops), label="op")
    f = _pick(data, files)
    if op == "truncate":
        _truncate(f, data)
    elif op == "flip":
        _flip(f, data)
    elif op == "delete":
        f.unlink()
    elif op == "hostile" and fmt == "dcp":
        if f.name == ".metadata":
            f.write_bytes(pickle.dumps(Planted(canary)))
        else:  # a blob: every storage entry of this file now holds the hostile pickle
            f.write_bytes(_zip_of(Planted(canary)))
        return True
    elif op == "hostile":
        _hostile_zip_member(f, canary)
        return True
    elif op == "json":
        if f.suffix == ".json":
            f.write_text(json.dumps(_mangle_json(json.loads(f.read_text()), data)))
        else:
            _mangle_safetensors_header(f, data)
    else:
        _mangle_metadata(d / ".metadata", data)
    return False


def _zip_of(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue() * 8  # long enough to cover every storage entry's byte range


# ---------------------------------------------------------------------------------------------
def check(pristine: Pristine, fmt: str, data: st.DataObject, tmp: Path) -> None:
    work = tmp / "work"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine.dirs[fmt], work)
    canary = tmp / "CANARY"
    hostile = mutate(fmt, work, canary, data)
    target = Pristine.target(fmt, work)
    outcomes: dict[str, Any] = {}
    for name, call in (("fingerprint_checkpoint", lambda: fsdpcheck.fingerprint_checkpoint(target)),
                       ("audit", lambda: fsdpcheck.audit(target))):  # fmt: skip
        try:
            outcomes[name] = bounded(call, WATCHDOG_S)
        except (ValueError, OSError) as exc:  # unreadable input: one line
            text = str(exc).strip()
            assert "\n" not in text, f"{name}: a multi-line message: {text!r}"
            assert "\x1b" not in text, f"{name}: colour codes in {text!r}"
        assert not canary.exists(), f"{name}: code from the checkpoint ran"
    fps = outcomes.get("fingerprint_checkpoint")
    if fps is not None and fps == pristine.fingerprints[fmt]:
        # fsdpcheck says every tensor is exactly the pristine one: torch must agree.
        assert not hostile, "a hostile file fingerprinted as the pristine checkpoint"
        try:
            seen = pristine.readers[fmt](work)
        except BaseException as exc:  # torch cannot read it: not pristine (DCP's errors are
            # BaseExceptions)
            pytest.fail(f"fingerprints say pristine, but torch cannot read it: {exc!r:.200}")
        assert _same(seen, pristine.data[fmt]), "fingerprints say pristine, the data differ"


@pytest.mark.parametrize("fmt", ["dcp", "safetensors", "torch_save"])
def test_fuzz_readers(pristine, fmt, tmp_path):
    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check(pristine, fmt, data, tmp_path)

    run()


def test_pristine_checkpoints_are_clean(pristine):
    for fmt, d in pristine.dirs.items():
        assert fsdpcheck.audit(Pristine.target(fmt, d)).ok, fmt
        assert len(pristine.fingerprints[fmt]) >= 3, fmt


@FUZZ
@given(doc=_json_value())
def test_fuzz_manifest_json(pristine, tmp_path_factory, doc):
    """A mangled fsdpcheck manifest is never executed and fails only with a clear line."""
    work = tmp_path_factory.mktemp("manifest")
    d = shutil.copytree(pristine.dirs["dcp"], work / "ck")
    (d / "fsdpcheck_manifest.json").write_text(json.dumps(doc))
    r = bounded(lambda: fsdpcheck.audit(d), WATCHDOG_S)
    for f in r.findings:
        assert "\n" not in f.message


# ---------------------------------------------------------------------------------------------
# Key names with control characters: nothing of them reaches the terminal raw, in any command.
_KEY_CHARS = st.characters(
    codec="utf-8",
    categories=("Cc", "Cf", "Zl", "Zp", "Zs", "Lu", "Nd"),
    include_characters="\n\r\x1b\x00\u202e\u2066[]:. ",
)
_FORMATS = ("safetensors", "torch_save", "dcp")


def _write_keys(fmt: str, path: Path, state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    if fmt == "safetensors":
        save_file(state, str(path.with_suffix(".safetensors")))
        return path.with_suffix(".safetensors")
    if fmt == "torch_save":
        torch.save(state, path.with_suffix(".pt"))
        return path.with_suffix(".pt")
    return save_dcp(path, dict(state))


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    """Runs a command in this process; its exit code and every line it printed."""
    import contextlib

    from fsdpcheck.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    lines = [ln for ln in (out.getvalue() + err.getvalue()).split("\n") if ln]
    for line in lines:
        assert line.isprintable(), f"{argv[0]}: a raw character reached the terminal: {line!r}"
    return code, lines


@FUZZ
@given(
    keys=st.lists(st.text(_KEY_CHARS, min_size=1, max_size=10), min_size=1, max_size=4,
                  unique=True),
    fmt=st.sampled_from(_FORMATS),
)  # fmt: skip
def test_fuzz_key_names_with_control_characters(tmp_path_factory, keys, fmt):
    """Every line printable; no extra verdict or finding line; --json keeps the keys exact."""
    from fsdpcheck.report import shown

    d = tmp_path_factory.mktemp("keys")
    state = {k: torch.full((2,), float(i + 1)) for i, k in enumerate(keys)}
    other = {**state, keys[0]: state[keys[0]] + 1}  # one real value finding
    a, b = _write_keys(fmt, d / "a", state), _write_keys(fmt, d / "b", other)
    code, lines = _cli(["compare", str(a), str(b), "--show-mapping"])
    assert code == 1
    assert [ln for ln in lines if ln.startswith("fsdpcheck:")] == [lines[0]]
    assert lines[0].startswith("fsdpcheck: FAILED with 1 finding(s)")
    assert [ln for ln in lines if ln.startswith("[")] == [f"[value] {shown(keys[0])}"]
    code, lines = _cli(["fingerprint", str(a), "--json"])
    fps = json.loads("\n".join(lines))
    assert code == 0 and set(fps) == set(keys)  # exact, as the file spells them
    code, lines = _cli(["fingerprint", str(a)])
    width = max(len(shown(k)) for k in fps)
    assert sorted(lines) == sorted(f"{shown(k):{width}s}  {v}" for k, v in fps.items())
    for command in ("inspect", "audit"):
        code, lines = _cli([command, str(a)])
        assert code == 0, lines
        assert not [ln for ln in lines if ln.startswith(("fsdpcheck: OK", "["))][1:], lines
