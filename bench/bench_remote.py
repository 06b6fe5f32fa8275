"""Checkpoints in object storage: the offline commands from a local S3 server against local disk.

Starts moto's S3 server on 127.0.0.1 (``moto[server]``, as the tests do), writes the data set
twice, once into the server and once on local disk: a DCP checkpoint (DCP's FsspecWriter into
the server, FileSystemWriter on disk) and a safetensors file (uploaded with s3fs), ``--size``
bytes each in bf16 tensors, and a second DCP copy on disk to compare against. Then, in this
process after its imports, the median of ``--reps`` runs of each:

  * ``fingerprint_checkpoint`` of the DCP checkpoint and of the safetensors file,
  * ``compare_checkpoints`` of each against the copy on disk,

once from ``s3://`` and once from the same files on disk (warm page cache), with the ratio
of the two times; and what was fetched from the server against what had to be read: bytes
(1.0x is every byte once; headers add a little), requests. A last row reads half the rows of
every tensor (what one of two ranks reads): bytes fetched against the bytes of those rows.

moto is a Python server (one process; a ranged GET reads the whole object before it slices
it, so each range costs time in proportion to its object's size): its pace, not S3's, sets the
remote times here. The ``floor`` rows fetch the same byte ranges with s3fs alone, concurrently:
the server's own pace, against which fsdpcheck's remote times compare. The byte counts are the
same against any S3.

Examples:
    python bench/bench_remote.py                     # 128 MB per checkpoint
    python bench/bench_remote.py --size 64M --reps 1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NTENSORS = 64
COLS = 4096


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _median(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times = []
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=_size, default=_size("128M"), help="bytes per checkpoint")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    from tests.s3_server import CREDENTIALS, MotoServer

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = MotoServer(work / "moto.log")
    os.environ.update(CREDENTIALS)
    os.environ["AWS_ENDPOINT_URL"] = server.url
    try:
        _run(args, work, server)
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def _run(args: argparse.Namespace, work: Path, server: Any) -> None:
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import fsdpcheck
    from fsdpcheck._compat import fsspec_writer
    from fsdpcheck.reading.references import open_source
    from fsdpcheck.sources.base import Region
    from fsdpcheck.sources.remote import fetched, reset_fetched

    rows = max(2, args.size // (NTENSORS * COLS * 2))
    rows -= rows % 2
    g = torch.Generator().manual_seed(0)
    sd = {
        f"layers.{i}.weight": torch.randn(rows, COLS, generator=g).to(torch.bfloat16)
        for i in range(NTENSORS)
    }
    need = sum(t.numel() * t.element_size() for t in sd.values())
    fs = fsspec.filesystem("s3", endpoint_url=server.url, skip_instance_cache=True)
    fs.mkdir("bench")
    t0 = time.perf_counter()
    dcp.save({"model": sd}, storage_writer=fsspec_writer("s3://bench/dcp"), no_dist=True)
    dcp.save({"model": sd}, checkpoint_id=str(work / "dcp"), no_dist=True)
    dcp.save({"model": sd}, checkpoint_id=str(work / "dcp2"), no_dist=True)
    save_file(sd, str(work / "m.safetensors"))
    fs.put(str(work / "m.safetensors"), "bench/m.safetensors")
    print(f"data: {NTENSORS} bf16 tensors of {rows} x {COLS}, {need / 1e6:,.0f} MB per "
          f"checkpoint, written in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    print(f"machine: {_machine()}, {os.cpu_count()} CPUs; server: moto {server.url}")
    print()
    cases = [
        ("fingerprint DCP", lambda w: fsdpcheck.fingerprint_checkpoint(w("dcp"))),
        ("fingerprint safetensors", lambda w: fsdpcheck.fingerprint_checkpoint(w("m.safetensors"))),
        ("compare DCP vs disk", lambda w: fsdpcheck.compare_checkpoints(w("dcp"), work / "dcp2")),
        (
            "compare safetensors vs disk",
            lambda w: fsdpcheck.compare_checkpoints(w("m.safetensors"), work / "dcp2"),
        ),
    ]
    remote = lambda name: f"s3://bench/{name}"  # noqa: E731
    local = lambda name: work / name  # noqa: E731
    cols = (
        ("disk s", 8),
        ("s3 s", 8),
        ("ratio", 6),
        ("fetched", 9),
        ("x needed", 8),
        ("requests", 8),
    )
    print(f"{'':28s} " + " ".join(f"{c:>{w}s}" for c, w in cols))
    for name, fn in cases:
        t_local, a = _median(lambda fn=fn: fn(local), args.reps)
        reset_fetched()
        t_remote, b = _median(lambda fn=fn: fn(remote), args.reps)
        got = fetched()
        same = a == b if isinstance(a, dict) else (a.ok and b.ok)
        per = args.reps
        print(
            f"{name:28s} {t_local:8.2f} {t_remote:8.2f} {t_remote / t_local:6.1f} "
            f"{got['bytes'] / per / 1e6:7.1f}MB {got['bytes'] / per / need:8.4f} "
            f"{got['requests'] // per:8d}" + ("" if same else "   RESULTS DIFFER")
        )
    # The server's own pace: the same byte ranges (every chunk's record, every tensor's bytes)
    # fetched by s3fs alone, concurrently (``cat_ranges``), nothing done with them.
    for name, where in (
        ("floor: s3fs, DCP ranges", "dcp"),
        ("floor: s3fs, st ranges", "m.safetensors"),
    ):
        src = open_source(remote(where))
        if where == "dcp":
            idx = src.index  # type: ignore[attr-defined]
            spans = [idx.storage(e)[:3] for e in range(idx.entry_where.shape[0])]
            paths = [f"bench/dcp/{rel}" for rel, _, _ in spans]
            starts = [off for _, off, _ in spans]
            ends = [off + n for _, off, n in spans]
        else:
            es = [e for e in src.entries().values() if e.is_tensor]
            paths = [f"bench/{where}"] * len(es)
            starts = [e.start for e in es]  # type: ignore[attr-defined]
            ends = [e.start + e.dtype.itemsize * math.prod(e.shape) for e in es]  # type: ignore[attr-defined]
        src.close()
        t, got = _median(lambda p=paths, a=starts, b=ends: fs.cat_ranges(p, a, b), args.reps)
        print(
            f"{name:28s} {'':8s} {t:8.2f} {'':6s} {sum(map(len, got)) / 1e6:7.1f}MB "
            f"{sum(map(len, got)) / need:8.4f} {len(paths):8d}"
        )
    # Half the rows of every tensor (one of two ranks): only those rows are fetched.
    for name, where in (("half: DCP", "dcp"), ("half: safetensors", "m.safetensors")):
        src = open_source(remote(where))
        keys = [k for k in src.entries() if src.entries()[k].is_tensor]
        regions = [Region(k, (0, 0), (rows // 2, COLS)) for k in keys]
        reset_fetched()
        t0 = time.perf_counter()
        for i in range(0, len(regions), 8):
            src.read(regions[i : i + 8], torch.device("cpu"))
        dt = time.perf_counter() - t0
        src.close()
        got = fetched()
        print(
            f"{name:28s} {'':8s} {dt:8.2f} {'':6s} {got['bytes'] / 1e6:7.1f}MB "
            f"{got['bytes'] / (need / 2):8.4f} {got['requests']:8d}"
        )


if __name__ == "__main__":
    main()
