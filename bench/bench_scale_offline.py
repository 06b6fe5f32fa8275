"""Offline commands at scale: a million DCP chunks, a million safetensors entries, 100k tensors.

Builds (once, cached under ``--keep``) and times, each command in a fresh process, wall time,
CPU time (user + system of the child) and peak RSS (``ru_maxrss`` of the child), with the
machine's load average when it ran (on a shared machine, CPU seconds move far less with the
load than wall seconds do):

  * ``chunks``: a DCP ``.metadata`` of 1,000 tensors x 1,024 saving ranks (1,024,000 chunks),
    built with DCP's own metadata classes the way ``dcp.save`` builds it (each rank's plan and
    write results pickled and unpickled, as the gather to the coordinator does, then one
    ``pickle.dump``), beside 1,024 sparse ``.distcp`` files of the sizes it names:
    ``fsdpcheck audit`` and ``fsdpcheck inspect --json``.
  * ``shapes`` (or any of ``CHUNK_SHAPES`` by name): the same 1,024,000 chunks pickled the other
    ways ``pickle.dump`` can write DCP's classes (path strings per entry, storage entries tensor
    by tensor, offsets or sizes shared, protocols 2, 3 and 5, enum members by name, several at
    once): ``fsdpcheck audit`` of each.
  * ``st``: one safetensors file of 1,000,000 tiny tensors: ``inspect`` and ``compare`` of the
    file with itself.
  * ``dcp``: a real ``dcp.save`` of 100,000 small tensors: ``inspect``, ``compare`` with
    itself, ``fingerprint`` and ``audit``.

Examples:
    python bench/bench_scale_offline.py --keep /tmp/fsdpcheck-scale
    python bench/bench_scale_offline.py --keep /tmp/fsdpcheck-scale --cases chunks --reps 3
    python bench/bench_scale_offline.py --keep /tmp/fsdpcheck-scale --cases chunks,shapes
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


#: The ways ``pickle.dump`` can write the same 1,024,000 chunks (every one audits through the
#: column runs: NOTE: [metadata columns] in ``fsdpcheck/sources/dcp/runs.py``). "chunks" is
#: how ``dcp.save`` writes them; each other one changes one thing (the last, several).
CHUNK_SHAPES: dict[str, dict[str, Any]] = {
    "chunks": {},
    # A fresh path string per storage entry (pickle writes it in full each time, not a memo
    # reference): a writer that builds the file name per entry.
    "chunks-fresh-paths": {"paths": "fresh"},
    # storage_data tensor by tensor (every rank's entry of a tensor, then the next tensor).
    "chunks-by-tensor": {"order": "tensor"},
    # Each MetadataIndex holds its chunk's own offsets object (a memo reference into the chunk).
    "chunks-shared-offsets": {"offsets": "shared"},
    # Every chunk of a rank shares one sizes object (a memo reference into an earlier chunk).
    "chunks-shared-sizes": {"sizes": "shared"},
    "chunks-p2": {"protocol": 2},
    "chunks-p3": {"protocol": 3},
    "chunks-p5": {"protocol": 5},
    # Enum members pickled by name, as CPython 3.11.0-3.11.3 does (``getattr(Enum, NAME)``).
    "chunks-enum-names": {"enums": "names"},
    "chunks-mixed": {"paths": "fresh", "order": "tensor", "offsets": "shared", "protocol": 2},
}


def build_chunks(root: Path, shape: str = "chunks") -> Path:
    """A DCP directory whose .metadata lists 1,000 x 1,024 chunks (data files sparse).

    `shape` names one of `CHUNK_SHAPES`: the same metadata, pickled another way.
    """
    import copyreg

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    how = CHUNK_SHAPES[shape]
    path = root / f"{shape.replace('-', '_')}_dcp"
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
    per_rank: list[list[Any]] = []
    for rank in range(RANKS):
        rel = f"__{rank}_0.distcp"
        sizes = torch.Size([ROWS_PER_RANK, COLS])
        chunks, results = [], []
        for i, n in enumerate(names):
            off = torch.Size([rank * ROWS_PER_RANK, 0])
            size = sizes if how.get("sizes") == "shared" else torch.Size([ROWS_PER_RANK, COLS])
            chunk = ChunkStorageMetadata(off, size)
            chunks.append((n, chunk))
            idx = MetadataIndex(n, off)
            if how.get("offsets") == "shared":
                object.__setattr__(idx, "offset", chunk.offsets)
            # "fresh": a new string object per entry (an f-string builds one each time).
            where = f"__{rank}_0.distcp" if how.get("paths") == "fresh" else rel
            results.append((idx, _StorageInfo(where, i * chunk_bytes, chunk_bytes)))
        # Each rank's plan and results reach the coordinator pickled (distinct objects per rank).
        chunks, results = pickle.loads(pickle.dumps((chunks, results)))
        for n, c in chunks:
            state[n].chunks.append(c)
        per_rank.append(results)
        with open(path / rel, "wb") as f:
            f.truncate(TENSORS * chunk_bytes)
    storage: dict[Any, Any] = {}
    if how.get("order") == "tensor":
        for i in range(TENSORS):
            storage.update(results[i] for results in per_rank)
    else:
        for results in per_rank:
            storage.update(results)
    md = Metadata(
        state_dict_metadata=state,
        planner_data={n: (n,) for n in names},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(path)),
        version="1.0.0",
    )
    by_name = how.get("enums") == "names"
    if by_name:  # CPython 3.11.2's Enum.__reduce_ex__
        copyreg.pickle(_MEM_FORMAT_ENCODING, lambda m: (getattr, (type(m), m.name)))
    try:
        with open(path / ".metadata.tmp", "wb") as f:
            pickle.dump(md, f, protocol=how.get("protocol", pickle.DEFAULT_PROTOCOL))
    finally:
        if by_name:
            copyreg.dispatch_table.pop(_MEM_FORMAT_ENCODING, None)
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


def run(argv: list[str]) -> tuple[float, int, int, str, float]:
    """(wall s, peak RSS bytes, exit code, last line of stderr, CPU s).

    CPU seconds (user + system of the child) are printed beside wall time: on a machine shared
    with other jobs they move far less than the wall time does.
    """
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        fe.seek(0)
        err = fe.read().decode(errors="replace").strip().splitlines()
    cpu = usage.ru_utime + usage.ru_stime
    return wall, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), (err or [""])[-1], cpu


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
    builders: dict[str, Any] = {"st": build_st, "dcp": build_dcp}
    for shape in CHUNK_SHAPES:
        builders[shape] = lambda root, shape=shape: build_chunks(root, shape)
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
    for shape in CHUNK_SHAPES:
        if shape != "chunks" and (shape in cases or "shapes" in cases):
            rows.append((f"1M {shape}: audit", [*fsd, "audit", built(shape)]))
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
        load = os.getloadavg()[0]  # the last minute's, as the command ends
        wall = statistics.median(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        cpu = statistics.median(r[4] for r in runs)
        results.append(
            {"name": name, "wall": wall, "cpu": cpu, "rss": rss, "rc": runs[-1][2], "load": load}
        )
        tail = runs[-1][3][:80]
        print(
            f"{name:36} {wall:7.2f} s {cpu:7.2f} s CPU {rss / 2**20:8.0f} MB  load {load:5.1f}  "
            f"rc={runs[-1][2]}  {tail}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
