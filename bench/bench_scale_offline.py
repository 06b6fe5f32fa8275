"""Offline commands at scale: a million DCP chunks, a million safetensors entries, 100k tensors.

Builds (once, cached under ``--keep``) and times, each command in a fresh process, wall time
and peak RSS (``ru_maxrss`` of the child):

  * ``chunks``: a DCP ``.metadata`` of 1,000 tensors x 1,024 saving ranks (1,024,000 chunks),
    built with DCP's own metadata classes the way ``dcp.save`` builds it (each rank's plan and
    write results pickled and unpickled, as the gather to the coordinator does, then one
    ``pickle.dump``), beside 1,024 sparse ``.distcp`` files of the sizes it names:
    ``fsdpcheck audit`` and ``fsdpcheck inspect --json``.
  * ``st``: one safetensors file of 1,000,000 tiny tensors: ``inspect`` and ``compare`` of the
    file with itself.
  * ``dcp``: a real ``dcp.save`` of 100,000 small tensors: ``inspect``, ``compare`` with
    itself, ``fingerprint`` and ``audit``.

Examples:
    python bench/bench_scale_offline.py --keep /tmp/fsdpcheck-scale
    python bench/bench_scale_offline.py --keep /tmp/fsdpcheck-scale --cases chunks --reps 3
    python bench/bench_scale_offline.py --cases chunks --src /tmp/base  # an older checkout
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CLI = "import fsdpcheck.cli as cli\ncli.run()"

TENSORS, RANKS, ROWS_PER_RANK, COLS = 1000, 1024, 4, 64
ST_ENTRIES = 1_000_000
DCP_TENSORS = 100_000


def build_chunks(root: Path) -> Path:
    """A DCP directory whose .metadata lists 1,000 x 1,024 chunks (data files sparse)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = root / "chunks_dcp"
    if (path / ".metadata").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{i}.weight" for i in range(TENSORS)]
    props = TensorProperties(dtype=torch.bfloat16)
    chunk_bytes = ROWS_PER_RANK * COLS * 2 + 1024  # the tensor's bytes plus torch.save's zip
    state: dict[str, Any] = {
        n: TensorStorageMetadata(props, torch.Size([RANKS * ROWS_PER_RANK, COLS]), [])
        for n in names
    }
    storage: dict[Any, Any] = {}
    for rank in range(RANKS):
        rel = f"__{rank}_0.distcp"
        chunks, results = [], []
        for i, n in enumerate(names):
            off = torch.Size([rank * ROWS_PER_RANK, 0])
            chunks.append((n, ChunkStorageMetadata(off, torch.Size([ROWS_PER_RANK, COLS]))))
            info = _StorageInfo(rel, i * chunk_bytes, chunk_bytes)
            results.append((MetadataIndex(n, off), info))
        # Each rank's plan and results reach the coordinator pickled (distinct objects per rank).
        chunks, results = pickle.loads(pickle.dumps((chunks, results)))
        for n, c in chunks:
            state[n].chunks.append(c)
        storage.update(results)
        with open(path / rel, "wb") as f:
            f.truncate(TENSORS * chunk_bytes)
    md = Metadata(
        state_dict_metadata=state,
        planner_data={n: (n,) for n in names},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(path)),
        version="1.0.0",
    )
    with open(path / ".metadata.tmp", "wb") as f:
        pickle.dump(md, f)
    os.replace(path / ".metadata.tmp", path / ".metadata")
    return path


def build_st(root: Path) -> Path:
    """One safetensors file of 1,000,000 one-element tensors (header written by hand)."""
    path = root / "million.safetensors"
    if path.exists():
        return path
    header: dict[str, Any] = {}
    for i in range(ST_ENTRIES):
        header[f"model.layers.{i // 1000}.experts.{i % 1000}.scale"] = {
            "dtype": "F32",
            "shape": [1],
            "data_offsets": [4 * i, 4 * i + 4],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path.with_suffix(".tmp"), "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.write(bytes(4 * ST_ENTRIES))
    os.replace(path.with_suffix(".tmp"), path)
    return path


def build_dcp(root: Path) -> Path:
    """A real dcp.save (one process) of 100,000 tensors of 16 floats."""
    path = root / "many_dcp"
    if (path / ".metadata").exists():
        return path
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"sd = {{f'model.block{{i // 100}}.w{{i % 100}}': torch.randn(4, 4, generator=g) "
        f"for i in range({DCP_TENSORS})}}\n"
        "dcp.save(sd, checkpoint_id=sys.argv[1], no_dist=True)\n"
    )
    subprocess.run([PY, "-c", code, str(path)], check=True)
    return path


def run(argv: list[str]) -> tuple[float, int, int, str]:
    """(wall s, peak RSS bytes, exit code, first line of stderr)."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        fe.seek(0)
        err = fe.read().decode(errors="replace").strip().splitlines()
    return wall, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), (err or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "fsdpcheck-scale")
    ap.add_argument("--cases", default="chunks,st,dcp")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--build", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--src",
        type=Path,
        default=None,
        help="time the fsdpcheck package in this folder instead (a baseline checkout whose "
        "fsdpcheck/ holds the built extension)",
    )
    args = ap.parse_args()
    builders = {"chunks": build_chunks, "st": build_st, "dcp": build_dcp}
    if args.build:
        print(builders[args.build](args.keep))
        return
    args.keep.mkdir(parents=True, exist_ok=True)
    cases = args.cases.split(",")
    pre = ""
    if args.src is not None:  # as bench_offline: the editable install's finder set aside
        pre = (
            "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
            f"type(f).__module__]\nsys.path.insert(0, {str(args.src)!r})\n"
        )
    fsd = [PY, "-c", pre + CLI]
    rows: list[tuple[str, list[str]]] = []
    t0 = time.perf_counter()

    def built(case: str) -> str:
        # In a child: a child's peak RSS counts what it inherited from this process.
        cmd = [PY, __file__, "--keep", str(args.keep), "--build", case]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    if "chunks" in cases:
        d = built("chunks")
        rows += [
            ("1M chunks: audit", [*fsd, "audit", d]),
            ("1M chunks: inspect", [*fsd, "inspect", d]),
        ]
    if "st" in cases:
        f = built("st")
        rows += [
            ("1M safetensors: inspect", [*fsd, "inspect", f]),
            ("1M safetensors: compare", [*fsd, "compare", f, f]),
        ]
    if "dcp" in cases:
        d = built("dcp")
        rows += [
            ("100k DCP tensors: inspect", [*fsd, "inspect", d]),
            ("100k DCP tensors: compare", [*fsd, "compare", d, d]),
            ("100k DCP tensors: fingerprint", [*fsd, "fingerprint", d]),
            ("100k DCP tensors: audit", [*fsd, "audit", d]),
        ]
    print(f"# data ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows.insert(0, ("startup: fsdpcheck info", [*fsd, "info"]))
    results = []
    for name, argv in rows:
        runs = [run(argv) for _ in range(args.reps)]
        wall = statistics.median(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        results.append({"name": name, "wall": wall, "rss": rss, "rc": runs[-1][2]})
        tail = runs[-1][3][:80]
        print(
            f"{name:36} {wall:7.2f} s {rss / 2**20:8.0f} MB  rc={runs[-1][2]}  {tail}", flush=True
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
