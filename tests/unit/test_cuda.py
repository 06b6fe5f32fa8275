"""The CUDA implementation gives the CPU's answers (skipped cleanly without a CUDA device)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpcheck
from tests import backends
from tests.cases import ALL_DTYPES, CHUNK, Case, assert_diff_matches, cases, make_values, perturb
from tests.unit.test_emulator import LAYOUTS, laid_out, planted

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.cuda


def _both(cs: list[Case], **kw) -> tuple[list[fsdpcheck.TensorDiff], list[fsdpcheck.TensorDiff]]:
    args = ([c.actual for c in cs], [c.expected for c in cs], [c.box for c in cs])
    return backends.compare("cpu", *args, **kw), backends.compare("cuda", *args, **kw)


def _assert_same(cpu: fsdpcheck.TensorDiff, gpu: fsdpcheck.TensorDiff) -> None:
    backends.assert_agree({"cpu": [cpu], "cuda": [gpu]})
    if cpu.sum is not None:
        for x, y in ((cpu.sum, gpu.sum), (cpu.sumsq, gpu.sumsq)):
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-9, abs=1e-12)


@given(cases())
def test_cuda_matches_reference_and_cpu(c: Case):
    (cpu,), (gpu,) = _both([c], rtol=c.rtol, atol=c.atol, equal_nan=c.equal_nan)
    assert_diff_matches(gpu, c.reference(), c.gshape, "cuda")
    _assert_same(cpu, gpu)


@given(st.lists(cases(max_numel=700), min_size=1, max_size=16))
def test_cuda_many_pairs_one_launch(cs: list[Case]):
    cpu, gpu = _both(cs, rtol=0.1)
    for x, y in zip(cpu, gpu):
        _assert_same(x, y)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 9])
@pytest.mark.parametrize("misalign", [0, 1])
def test_cuda_sizes_alignment_and_tails(dtype, n, misalign):
    gen = torch.Generator().manual_seed(n + misalign)
    a = make_values((n + misalign,), dtype, gen)
    e = perturb(a, 9, gen, 1e-3)
    # misalign=1 starts the views one element in: no 16-byte vector loads, the scalar path.
    c = Case(a[misalign:], e[misalign:], None, 0.0, 0.0, True)
    cpu = fsdpcheck.compare([c.actual], [c.expected])[0]
    gpu = fsdpcheck.compare([a.cuda()[misalign:]], [e.cuda()[misalign:]])[0]
    _assert_same(cpu, gpu)
    assert_diff_matches(gpu, c.reference(), c.gshape, "cuda")
    assert fsdpcheck.fingerprint_tensor(a.cuda()[misalign:]) == cpu.fingerprint_actual


# The emulator runs a block per chunk and per tensor on the CPU (~20 ms each): few examples.
@settings(max_examples=15)
@given(st.lists(cases(max_numel=2000), min_size=1, max_size=4))
def test_cuda_rows_equal_the_emulators(cs: list[Case]):
    args = ([c.actual for c in cs], [c.expected for c in cs], [c.box for c in cs])
    backends.assert_agree({b: backends.compare(b, *args, rtol=1e-3) for b in backends.ALL})


@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_rows_equal_the_emulators_on_every_path(dtype, how):
    a, e = planted(dtype, ALL_DTYPES.index(dtype))
    la, le = laid_out(a, how), laid_out(e, how)
    got = {b: backends.compare(b, [la], [le], rtol=1e-3) for b in ("emulated", "cuda")}
    backends.assert_agree(got)
    assert backends.fingerprints("cuda", [la]) == backends.fingerprints("emulated", [la])


def test_cuda_misaligned_input_is_refused_before_launch():
    class Raw:  # a CUDA buffer one byte past a float16 boundary (as DLPack can hand over)
        def __init__(self, ptr: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (8,),
                "typestr": "<f2",
                "data": (ptr, False),
                "version": 3,
                "strides": None,
            }

    base = torch.zeros(64, dtype=torch.uint8, device="cuda")
    odd = torch.as_tensor(Raw(base.data_ptr() + 1), device="cuda")
    ok = torch.zeros(8, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=r"compare: expected\[1\] on cuda:0 starts at byte"):
        fsdpcheck.compare([ok, ok], [ok, odd])
    with pytest.raises(ValueError, match=r"fingerprint_tensors: tensors\[0\] on cuda:0"):
        fsdpcheck.fingerprint_tensors([odd])
    with pytest.raises(ValueError, match=r"fsdpcheck.compare: actual\[0\] starts at address"):
        torch.ops.fsdpcheck.compare.default([odd], [ok], [], [], 0.0, 0.0, True, True, True)
    torch.cuda.synchronize()  # the context survived: nothing was launched on the bad pointer
    assert fsdpcheck.compare([ok], [ok.clone()])[0].ok


def test_cuda_fingerprints_equal_cpu_for_every_dtype_and_box():
    gen = torch.Generator().manual_seed(0)
    ts, boxes = [], []
    for dtype in ALL_DTYPES:
        full = make_values((33, 70), dtype, gen)
        ts += [full, full[5:9], full[:, 13:40]]
        boxes += [None, fsdpcheck.Box((33, 70), (5, 0)), fsdpcheck.Box((33, 70), (0, 13))]
    cpu = fsdpcheck.fingerprint_tensors(ts, boxes=boxes)
    gpu = fsdpcheck.fingerprint_tensors([t.cuda() for t in ts], boxes=boxes)
    assert cpu == gpu


def test_cuda_huge_offsets_and_determinism():
    t = torch.randn(5000, device="cuda")
    e = t.clone()
    e[4321] += 1
    box = fsdpcheck.Box((2**40,), (2**40 - 5000,))
    runs = [fsdpcheck.compare([t], [e], boxes=[box])[0] for _ in range(3)]
    assert runs[0].max_abs_index == (2**40 - 5000 + 4321,)
    assert all(repr(r) == repr(runs[0]) for r in runs)
    (cpu,) = fsdpcheck.compare([t.cpu()], [e.cpu()], boxes=[box])
    _assert_same(cpu, runs[0])


def test_cuda_mixed_devices_are_grouped_in_one_call():
    a = [torch.randn(10), torch.randn(10, device="cuda")]
    e = [a[0].clone(), a[1].clone()]
    e[1][3] = 0
    out = fsdpcheck.compare(a, e)
    assert out[0].ok and out[1].max_abs_index == (3,)


def test_cuda_pair_on_two_devices_is_refused():
    with pytest.raises(ValueError, match="move both to one device"):
        fsdpcheck.compare([torch.zeros(3)], [torch.zeros(3, device="cuda")])


def test_cuda_runs_on_current_stream():
    s = torch.cuda.Stream()
    a = torch.randn(1 << 20, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        e = a.clone()  # enqueued on s: compare must be ordered after it on the same stream
        (d,) = fsdpcheck.compare([a], [e])
    assert d.ok


def test_cuda_opcheck():
    a = [torch.randn(5, 3, device="cuda"), torch.randint(0, 5, (4,), device="cuda")]
    e = [x.clone() for x in a]
    torch.library.opcheck(
        torch.ops.fsdpcheck.compare.default, (a, e, [], [], 0.0, 0.0, True, True, True)
    )
    torch.library.opcheck(torch.ops.fsdpcheck.fingerprint.default, (a, [], []))


def test_cuda_backend_compiled():
    assert "cuda" in fsdpcheck.build_info()["backends"]


def test_cuda_verify_fingerprint_and_load_in_one_process(tmp_path):
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).cuda()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 5, device="cuda")).sum().backward()
    opt.step()
    fsdpcheck.save(m, tmp_path / "ck", optimizer=opt)
    r = fsdpcheck.verify(m, tmp_path / "ck", optimizer=opt)
    assert r.ok, str(r)
    on_gpu = fsdpcheck.fingerprint(m, optimizer=opt)
    cpu_model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    cpu_model.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    assert fsdpcheck.fingerprint(cpu_model) == {
        k: v for k, v in on_gpu.items() if not k.startswith("optim.")
    }
    assert fsdpcheck.fingerprint_checkpoint(tmp_path / "ck") == on_gpu
    with torch.no_grad():
        m[0].weight[2, 1] += 1
    (f,) = fsdpcheck.verify(m, tmp_path / "ck", optimizer=opt).findings
    assert f.key == "0.weight" and f.max_abs_index == (2, 1)
    # Many small batches: pinned host buffers, copies on the side stream, two in flight.
    (f,) = fsdpcheck.verify(m, tmp_path / "ck", optimizer=opt, memory_budget=64).findings
    assert f.key == "0.weight" and f.max_abs_index == (2, 1) and f.mismatched == 1
    m2 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).cuda()
    assert fsdpcheck.load(m2, tmp_path / "ck").ok
