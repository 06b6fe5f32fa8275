"""The per-dtype tables held to the one compiled dtype table (csrc/fsdpcheck/dtypes.h).

The C++ lists are generated from that table; these tests hold every table kept in Python (and
the SASS report's reading of the header) to what the extension reports, so a dtype added to the
C++ table fails here until each of them has its row.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import fsdpcheck
from fsdpcheck import kernels
from fsdpcheck.kernels import KERNEL_DTYPES, SUPPORTED_DTYPES
from fsdpcheck.sentinel import _SENTINEL_BITS
from fsdpcheck.sources.safetensors_files import _BITS, _SAFETENSORS_DTYPES
from fsdpcheck.tolerances import DTYPE_TOLERANCES, tolerance
from tests import REPO_ROOT

ROOT = REPO_ROOT
FLOATS = {k.dtype for k in KERNEL_DTYPES if k.kind == "float"}


def test_build_info_reports_the_compiled_table():
    info = fsdpcheck.build_info()["dtypes"]
    assert info == {k.name: {"code": k.code, "size": k.size, "kind": k.kind} for k in KERNEL_DTYPES}
    # The twelve dtypes of the kernel contract (docs/kernel-api.md), in the table's order.
    assert [k.name for k in KERNEL_DTYPES] == [
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int8", "int16", "int32", "int64", "uint8", "bool",
    ]  # fmt: skip
    assert len({k.code for k in KERNEL_DTYPES}) == len(KERNEL_DTYPES)
    compiled = {k.dtype for k in KERNEL_DTYPES}
    assert compiled == SUPPORTED_DTYPES


@pytest.mark.parametrize("k", KERNEL_DTYPES, ids=lambda k: k.name)
def test_each_row_agrees_with_torch(k):
    assert isinstance(k.dtype, torch.dtype)
    assert k.size == k.dtype.itemsize
    want = "bool" if k.dtype == torch.bool else "float" if k.dtype.is_floating_point else "int"
    assert k.kind == want
    # A tensor of it goes through both operators (its kernel trait is compiled in).
    t = torch.zeros(3, dtype=k.dtype)
    assert kernels.fingerprint_tensor(t) == kernels.fingerprint_tensor(t.clone())
    assert kernels.compare([t], [t.clone()])[0].ok


def test_tolerances_have_one_row_per_float_dtype():
    assert set(DTYPE_TOLERANCES) == FLOATS
    # NOTE: [precision order] in tolerances.py: the looser row is the less precise dtype.
    by_tolerance = sorted(FLOATS, key=lambda d: DTYPE_TOLERANCES[d])
    by_precision = sorted(FLOATS, key=lambda d: torch.finfo(d).eps)
    assert by_tolerance == by_precision
    assert len({DTYPE_TOLERANCES[d] for d in FLOATS}) == len(FLOATS)
    for a in FLOATS:
        for b in FLOATS - {a}:
            loose = a if torch.finfo(a).eps > torch.finfo(b).eps else b
            assert tolerance(a, b, None, None) == DTYPE_TOLERANCES[loose]


def test_sentinels_cover_every_dtype_but_bool():
    assert set(_SENTINEL_BITS) == {k.dtype for k in KERNEL_DTYPES if k.kind != "bool"}
    for dtype, (view, bits) in _SENTINEL_BITS.items():
        assert view.itemsize == dtype.itemsize, dtype
        t = torch.zeros(2, dtype=dtype)
        t.view(view).fill_(bits)
        if dtype.is_floating_point:
            # A NaN: no finite value a load copies can be mistaken for it.
            assert bool(t.float().isnan().all()), dtype
        else:
            info = torch.iinfo(dtype)
            assert int(t[0]) in (info.min, info.max), dtype


def test_safetensors_names_are_compiled_dtypes_of_their_size():
    assert set(_SAFETENSORS_DTYPES.values()) <= SUPPORTED_DTYPES
    for name, dtype in _SAFETENSORS_DTYPES.items():
        assert _BITS[name] == 8 * dtype.itemsize, name


def test_unsupported_dtype_errors_list_the_compiled_dtypes():
    names = ", ".join(k.name for k in KERNEL_DTYPES)
    x = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(TypeError) as err:
        torch.ops.fsdpcheck.compare([x], [x], [], [], 0.0, 0.0, True, True, True)
    assert f"(supported: {names})" in str(err.value)
    with pytest.raises(TypeError, match="not supported") as err:
        kernels.compare([x], [x])
    assert ", ".join(sorted(k.name for k in KERNEL_DTYPES)) in str(err.value)


def test_sass_report_reads_the_same_table():
    spec = importlib.util.spec_from_file_location("sass_report", ROOT / "bench" / "sass_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    codes = {k.code: (k.name, k.size) for k in KERNEL_DTYPES}
    assert codes == module.DTYPE_CODES
