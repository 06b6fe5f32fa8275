"""Enum members pickled by name (CPython 3.11.2, Debian 12's ``python3``) in a DCP ``.metadata``.

CPython 3.11.0-3.11.3 pickles an enum member as ``builtins.getattr(EnumClass, "NAME")``; the
versions before and after pickle it by value. The restricted metadata reader admits exactly that
call for the enums a metadata holds (NOTE: [enum members by name] in ``fsdpcheck._unpickle``),
through its column fast path and its object path alike, and refuses every other call of getattr.

Shown three ways:
* with the real pickler of the system's CPython 3.11.2 (``/usr/bin/python3``, importing torch and
  fsdpcheck from this environment: the same ABI), writing with ``dcp.save``, with DCP's classes
  pickled by hand (many chunks: column runs) and with ``fsdpcheck.save``;
* on any Python, with ``Enum.__reduce_ex__`` of 3.11.2 emulated through ``copyreg``, after a test
  that the emulation writes byte for byte what that Python writes for a plain enum;
* refusals: getattr of anything but an admitted enum's member, on every reader.
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import json
import os
import pickle
import pickletools
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata
from torch.distributed.checkpoint.planner import WriteItemType

import fsdpcheck
from fsdpcheck._unpickle import UnsafePickleError
from fsdpcheck.sources.dcp import stream as dcp_pickle
from fsdpcheck.sources.dcp.metadata import _mirror, read_dcp_metadata
from tests import REPO_ROOT
from tests.hostile.test_reading import read_both, trusted_summary, write_dcp

REPO = REPO_ROOT
SYSTEM_PYTHON = Path("/usr/bin/python3")
# This environment's packages (torch, fsdpcheck, the test libraries), for another interpreter of
# the same minor version: its own standard library (pickle, enum) and this torch.
SITE = sysconfig.get_paths()["purelib"]
_PRELUDE = f"import site, sys; site.addsitedir({SITE!r}); sys.path.insert(0, {str(REPO)!r})\n"


def _by_name(member: enum.Enum) -> tuple[Any, ...]:
    """CPython 3.11.2's ``Enum.__reduce_ex__``."""
    return getattr, (member.__class__, member._name_)


@contextlib.contextmanager
def members_by_name(*classes: type[enum.Enum]) -> Iterator[None]:
    """Pickles members of `classes` as CPython 3.11.2 does (copyreg's dispatch table)."""
    saved = {c: copyreg.dispatch_table.get(c) for c in classes}
    for c in classes:
        copyreg.pickle(c, _by_name)
    try:
        yield
    finally:
        for c, old in saved.items():
            if old is None:
                copyreg.dispatch_table.pop(c, None)
            else:
                copyreg.dispatch_table[c] = old


DCP_ENUMS = (_MEM_FORMAT_ENCODING, WriteItemType)


def system_python(code: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs `code` under ``/usr/bin/python3`` with this environment's packages."""
    return subprocess.run(
        [str(SYSTEM_PYTHON), "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )


def _system_python_problem(*, with_torch: bool) -> str | None:
    """Why the system Python cannot show the real pickler here (None: it can)."""
    if not SYSTEM_PYTHON.exists():
        return f"no {SYSTEM_PYTHON}"
    probe = system_python(
        f"import pickle, uuid{', torch, fsdpcheck' if with_torch else ''}\n"
        "print(b'getattr' in pickle.dumps(uuid.SafeUUID.safe, 4), sys.version.split()[0])",
        timeout=120,
    )
    if probe.returncode != 0:
        what = f"import torch and fsdpcheck from {SITE}" if with_torch else "run"
        return f"{SYSTEM_PYTHON} cannot {what}: {probe.stderr[-300:]}"
    by_name, version = probe.stdout.split()
    if by_name != "True":
        return f"{SYSTEM_PYTHON} is CPython {version}, which pickles enum members by value"
    return None


@pytest.fixture(scope="module")
def by_name_python() -> None:
    """The system Python pickles enum members by name (a plain enum of the standard library)."""
    problem = _system_python_problem(with_torch=False)
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def by_name_python_with_torch(by_name_python: None) -> None:
    """... and imports torch and fsdpcheck from this environment (seconds: the slow tests')."""
    problem = _system_python_problem(with_torch=True)
    if problem is not None:
        pytest.skip(problem)


def getattr_calls(data: bytes) -> int:
    """How many times a pickle names builtins.getattr (GLOBAL, or STACK_GLOBAL of two strings)."""
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what each op pushed: a string, or None for anything else
    calls = 0
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name == "STACK_GLOBAL":
            calls += pushed[-2:] == ["builtins", "getattr"]
            pushed.append(None)
        elif name == "GLOBAL":
            calls += arg in ("builtins getattr", "__builtin__ getattr")
            pushed.append(None)
        else:
            pushed.append(None)
    return calls


# ---------------------------------------------------------------------------------------------
# The emulation is what CPython 3.11.2 writes.
_PLAIN = "[uuid.SafeUUID.safe, uuid.SafeUUID.unsafe, uuid.SafeUUID.safe, uuid.SafeUUID.unknown]"


def test_the_emulation_writes_the_bytes_cpython_3_11_2_writes(by_name_python: None) -> None:
    # A plain enum of the standard library, no torch in the writing process.
    real = system_python(
        "import json, pickle, uuid\n"
        f"print(json.dumps([pickle.dumps({_PLAIN}, p).hex() for p in (2, 3, 4, 5)]))\n"
    )
    assert real.returncode == 0, real.stderr
    with members_by_name(uuid.SafeUUID):
        emulated = [pickle.dumps(eval(_PLAIN), p).hex() for p in (2, 3, 4, 5)]
    assert emulated == json.loads(real.stdout)
    assert all(getattr_calls(bytes.fromhex(h)) == 1 for h in emulated)  # once, then memoized
    if sys.version_info[:2] != (3, 11) or sys.version_info[2] > 3:
        assert pickle.dumps(uuid.SafeUUID.safe, 4).hex() not in emulated  # this Python: by value


# ---------------------------------------------------------------------------------------------
# The real pickler of CPython 3.11.2.
@pytest.mark.slow
def test_cpython_3_11_2_writes_metadata_fsdpcheck_reads_and_saves(
    by_name_python_with_torch: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = system_python(
        f"""
        import json, warnings
        import torch
        import torch.distributed.checkpoint as dcp
        import fsdpcheck
        from tests.hostile.test_reading import write_dcp

        warnings.simplefilter("ignore")
        root = {str(tmp_path)!r}
        # DCP's classes pickled by this Python: 8 chunks per tensor (column runs), protocol 2-5.
        tensors = {{f"layers.{{i}}.w": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}}
        for p in (2, 3, 4, 5):
            write_dcp(__import__("pathlib").Path(root, f"hand{{p}}"), tensors, 8, protocol=p,
                      values={{"opt.lr": 0.5}})
        # dcp.save itself, and fsdpcheck.save with an optimizer.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 5)).sum().backward()
        opt.step()
        dcp.save({{"model": model.state_dict()}}, checkpoint_id=root + "/dcp", no_dist=True)
        fsdpcheck.save(model, root + "/saved", optimizer=opt)
        fps = fsdpcheck.fingerprint(model, optimizer=opt)
        torch.save(model.state_dict(), root + "/model.pt")
        print(json.dumps({{"version": sys.version.split()[0], "fps": fps}}))
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["version"] == "3.11.2" or result["version"] != sys.version.split()[0]
    for name in ("hand2", "hand3", "hand4", "hand5", "dcp", "saved"):
        p = tmp_path / name
        assert getattr_calls((p / ".metadata").read_bytes()) >= 1, name  # the by-name form
        streamed, objects, runs = read_both(p, monkeypatch)
        assert streamed == objects == trusted_summary(p), name
        if name in ("hand4", "hand5"):
            assert runs > 0  # the column fast path read the chunk runs (MEMOIZE: protocol 4+)
        # DCP's own classes (handed to DCP's load): the member itself.
        md = read_dcp_metadata(p, dcp_classes=True)
        props = [m.properties for m in md.state_dict_metadata.values() if hasattr(m, "chunks")]
        assert props and all(pr.memory_format == torch.contiguous_format for pr in props)
    # fsdpcheck.save worked there: its manifest checks out here, value for value.
    assert fsdpcheck.audit(tmp_path / "saved", deep=True).ok
    fps = fsdpcheck.fingerprint_checkpoint(tmp_path / "saved")
    assert fps == result["fps"]
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    assert fsdpcheck.load(model, tmp_path / "saved", optimizer=opt).ok
    assert all(
        torch.equal(v, w)
        for v, w in zip(
            model.state_dict().values(),
            torch.load(tmp_path / "model.pt", weights_only=True).values(),
        )
    )


# ---------------------------------------------------------------------------------------------
# Emulated (any Python).
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_emulated_by_name_metadata_reads_on_both_paths(
    protocol: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"layers.{i}.w": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}
    with members_by_name(*DCP_ENUMS):
        p = write_dcp(tmp_path / "ck", tensors, 8, protocol=protocol, values={"opt.lr": 0.5})
    assert getattr_calls((p / ".metadata").read_bytes()) == 1  # once, then memoized
    streamed, objects, runs = read_both(p, monkeypatch)
    assert streamed == objects == trusted_summary(p)
    assert runs > 0 or protocol < 4  # column runs are MEMOIZE patterns: protocol 4 and 5
    md = read_dcp_metadata(p, dcp_classes=True)
    assert md.state_dict_metadata["layers.0.w"].properties.memory_format == torch.contiguous_format


def test_emulated_by_name_every_memory_format_and_a_planner_enum(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties

    p = write_dcp(tmp_path / "ck", {"a": torch.ones(2, 2), "b": torch.ones(3)}, 1)
    md = pickle.loads((p / ".metadata").read_bytes())
    formats = [torch.channels_last, torch.preserve_format]
    for fmt, key in zip(formats, ("a", "b")):
        old = md.state_dict_metadata[key].properties
        md.state_dict_metadata[key].properties = TensorProperties(old.dtype, memory_format=fmt)
    # megatron-core caches its save plan in planner_data: an enum of DCP's planner inside.
    md.planner_data = {"a": ("a",), "b": ("b",), "plan": [WriteItemType.SHARD]}
    with members_by_name(*DCP_ENUMS):
        (p / ".metadata").write_bytes(pickle.dumps(md))
    assert getattr_calls((p / ".metadata").read_bytes()) == 1
    for dcp_classes in (False, True):
        got = read_dcp_metadata(p, dcp_classes=dcp_classes)
        assert [got.state_dict_metadata[k].properties.memory_format for k in "ab"] == formats
    assert read_dcp_metadata(p, dcp_classes=True).planner_data["plan"] == [WriteItemType.SHARD]
    opaque = read_dcp_metadata(p).planner_data["plan"][0]
    assert type(opaque) is _mirror("torch.distributed.checkpoint.planner", "WriteItemType")
    assert opaque.args == ("SHARD",)  # kept, never interpreted


def test_emulated_by_name_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    with members_by_name(*DCP_ENUMS):
        fsdpcheck.save(model, tmp_path / "ck", optimizer=opt)
    assert getattr_calls((tmp_path / "ck" / ".metadata").read_bytes()) >= 1
    assert fsdpcheck.audit(tmp_path / "ck", deep=True).ok
    other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    o2 = torch.optim.AdamW(other.parameters())
    assert fsdpcheck.load(other, tmp_path / "ck", optimizer=o2).ok
    assert fsdpcheck.fingerprint(other, optimizer=o2) == fsdpcheck.fingerprint(model, optimizer=opt)


# ---------------------------------------------------------------------------------------------
# Refusals: getattr of anything but an admitted enum's member.
class _Call:
    """Pickles as ``getattr(*args)``."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return getattr, self.args


_REFUSED = {
    "a dunder of an admitted enum": (_MEM_FORMAT_ENCODING, "__class__"),
    "its member map": (_MEM_FORMAT_ENCODING, "_member_map_"),
    "a method of an admitted enum": (_MEM_FORMAT_ENCODING, "mro"),
    "a member's name with a default": (_MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST", None),
    "no name": (_MEM_FORMAT_ENCODING,),
    "a name that is not a string": (_MEM_FORMAT_ENCODING, 1),
    "another enum's member name": (WriteItemType, "TORCH_CHANNELS_LAST"),
    "an admitted class that is not an enum": (Metadata, "__init__"),
    "torch.Size": (torch.Size, "__new__"),
    "an admitted builtin": (set, "add"),
    "a member": (_MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST, "__class__"),
    "a string": ("TORCH_CHANNELS_LAST", "upper"),
}


def _hostile(tmp_path: Path, call: _Call, protocol: int) -> Path:
    p = write_dcp(tmp_path / "ck", {f"w{i}": torch.ones(8, 2) for i in range(3)}, 4)
    md = pickle.loads((p / ".metadata").read_bytes())
    md.planner_data["w0"] = (call,)
    (p / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    return p


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_getattr_of_anything_else_is_refused_on_every_reader(
    case: str, protocol: int, tmp_path: Path
) -> None:
    p = _hostile(tmp_path, _Call(*_REFUSED[case]), protocol)
    with members_by_name(*DCP_ENUMS):
        assert getattr_calls((p / ".metadata").read_bytes()) >= 1
    readers = {
        "objects": lambda fd: dcp_pickle.read_metadata_stream(fd, "m", _mirror, 1 << 30,
                                                              columns=False),
        "columns": lambda fd: dcp_pickle.read_metadata_stream(fd, "m", _mirror, 1 << 30),
        "dcp classes": lambda fd: dcp_pickle.read_metadata_stream(fd, "m", None, 1 << 30,
                                                                  columns=False),
    }  # fmt: skip
    for name, read in readers.items():
        fd = os.open(p / ".metadata", os.O_RDONLY)
        try:
            with pytest.raises(UnsafePickleError) as e:
                read(fd)
        finally:
            os.close(fd)
        assert "builtins.getattr" in str(e.value) and "refusing" in str(e.value), (name, case)
    # Through the public entry points: one finding naming the file, never a value.
    rep = fsdpcheck.audit(p)
    assert not rep.ok and "builtins.getattr" in rep.findings[0].message
    with pytest.raises(UnsafePickleError, match=r"builtins\.getattr"):
        fsdpcheck.fingerprint_checkpoint(p)


def test_getattr_of_a_class_outside_the_allowlist_is_refused_at_the_class(tmp_path: Path) -> None:
    p = _hostile(tmp_path, _Call(subprocess.Popen, "__init__"), 4)
    with pytest.raises(UnsafePickleError, match=r"subprocess\.Popen"):
        fsdpcheck.fingerprint_checkpoint(p)
