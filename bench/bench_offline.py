"""Offline commands against the speed of reading the bytes.

Builds the data set (two bf16 safetensors files of 96 tensors that differ in one element, and
a 4-rank ``fsdpcheck.save`` of the second one: a DCP directory with a manifest), then times, each
in a fresh process and each the median of ``--reps`` rounds (a round runs every row once):

  * ``cat`` of the same files (the floor: every byte read once), and the tools people reach for
    on the same bytes where installed: ``cmp a b``, ``xxh128sum``, ``b3sum`` and ``sha256sum``
    of the DCP files (Debian packages ``xxhash`` and ``b3sum``; not needed by CI),
  * the naive script users write (``load_file`` both + a ``torch.equal`` loop) and a plain
    ``dcp.load`` of the DCP directory into preallocated tensors (the DCP read floor in torch),
  * ``fsdpcheck compare a.safetensors b.safetensors``, ``fsdpcheck fingerprint b_dcp``,
    ``fsdpcheck audit --deep b_dcp`` and ``fsdpcheck.verify`` of the first file's tensors
    against the DCP directory; the fingerprint also with ``FSDPCHECK_READ=pread`` (no file
    mapped).

Reported per command: whole-process wall time, the time of the work alone (measured inside the
process after its imports; for a command line, its whole process minus ``fsdpcheck info`` in the
same round), GB/s of the bytes it must read, ratio to ``cat`` and to the naive
script, and the process's peak RSS. Warm runs read through a page cache filled by reading the
files once (after evicting them); ``--cold`` also evicts the files with
``posix_fadvise(DONTNEED)`` before each run (no root needed; pages still mapped elsewhere may
stay).

Examples:
    python bench/bench_offline.py                 # 1.3 GB per file
    python bench/bench_offline.py --size 200M --reps 1
    python bench/bench_offline.py --cold --keep /tmp/offline-data
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NTENSORS = 96
COLS = 4096
WORLD = 4
REPO = Path(__file__).resolve().parent.parent


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def _rows(size: int) -> int:
    """Rows per tensor (a multiple of the world size) so that the file holds about `size` bytes."""
    rows = max(WORLD, size // (NTENSORS * COLS * 2))
    return rows - rows % WORLD


def _tensors(rows: int, planted: bool = False) -> dict[str, Any]:
    """The 96 tensors; with `planted`, one element differs (the second file and the DCP save)."""
    import torch

    g = torch.Generator().manual_seed(0)
    t = {
        f"layers.{i}.weight": torch.randn(rows, COLS, generator=g).to(torch.bfloat16)
        for i in range(NTENSORS)
    }
    if planted:
        t[f"layers.{NTENSORS // 2}.weight"][rows // 3, 7] += 1.0
    return t


def _save_rank(rank: int, world: int, port: int, rows: int, path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdpcheck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.Module()
        layers = torch.nn.ModuleList()
        for w in _tensors(rows, planted=True).values():
            m = torch.nn.Module()
            m.weight = torch.nn.Parameter(w)
            layers.append(m)
        model.layers = layers
        fully_shard(model)
        fsdpcheck.save(model, path)
    finally:
        dist.destroy_process_group()


def build(root: Path, size: int) -> dict[str, Path]:
    """Writes a.safetensors, b.safetensors (one element differs) and b_dcp (4 ranks)."""
    from safetensors.torch import save_file

    from fsdpcheck._spawn import spawn

    rows = _rows(size)
    paths = {"a": root / "a.safetensors", "b": root / "b.safetensors", "dcp": root / "b_dcp"}
    save_file(_tensors(rows), str(paths["a"]))
    save_file(_tensors(rows, planted=True), str(paths["b"]))
    spawn(_save_rank, WORLD, (rows, str(paths["dcp"])))
    if not (paths["dcp"] / ".metadata").exists():
        raise SystemExit("the 4-rank save failed")
    return paths


def _files(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]


def _resident(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore over a mapping never read)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        for f in _files(p):
            size = f.stat().st_size
            if size == 0:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return float("nan")
                n = (size + page - 1) // page
                vec = ctypes.create_string_buffer(n)
                ok = libc.mincore(addr, size, vec) == 0
                libc.munmap(addr, size)
                if not ok:
                    return float("nan")
            finally:
                os.close(fd)
            resident += sum(b & 1 for b in vec.raw)
            total += n
    return resident / total if total else 0.0


def _evict(paths: list[Path]) -> None:
    """Drops the files from the page cache (no root needed), checked with mincore.

    One ``POSIX_FADV_DONTNEED`` can leave pages behind (pages a process that just exited still
    had mapped, pages on another CPU's LRU batch): it is repeated until under 1% are resident.
    """
    for _ in range(20):
        for p in paths:
            for f in _files(p):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        if not paths or _resident(paths) < 0.01:
            return
        time.sleep(0.05)
    print(f"# warning: {100 * _resident(paths):.0f}% of the files stay cached", file=sys.stderr)


def _run(argv: list[str]) -> tuple[float, float | None, int, str]:
    """(wall s, work s reported by the child or None, peak RSS bytes, stdout)."""
    # Output goes to files, not pipes: a pipe nobody reads would stall the child (cat).
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.perf_counter()
        sink = subprocess.DEVNULL if argv[0] == "cat" else fo
        proc = subprocess.Popen(argv, stdout=sink, stderr=fe, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        out = fo.read().decode(errors="replace") if argv[0] != "cat" else ""
        err = fe.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}\n{err}")
    work = None
    for line in out.splitlines():
        if line.startswith("WORK "):
            work = float(line.split()[1])
    return wall, work, usage.ru_maxrss * 1024, out


PY = sys.executable
# Each child times its own work after its imports and prints "WORK <seconds>".
# The clock starts after the imports and after one full garbage collection: the first one after
# importing torch scans the ~10^6 objects the import made (~45 ms), a start-up cost that any
# process pays once (a training job long before it checks anything), whichever call triggers it.
TIMED = """
import sys, time, json, gc
{imports}
gc.collect()
t0 = time.perf_counter()
{work}
print("WORK", time.perf_counter() - t0)
"""

NAIVE = TIMED.format(
    imports="import torch\nfrom safetensors.torch import load_file",
    work="a = load_file(sys.argv[1]); b = load_file(sys.argv[2])\n"
    "same = [k for k in a if torch.equal(a[k], b[k])]\nprint(len(a) - len(same), 'differ')",
)
NAIVE_DCP = TIMED.format(
    imports="import torch\nimport torch.distributed.checkpoint as dcp\n"
    "from torch.distributed.checkpoint import FileSystemReader",
    work="md = FileSystemReader(sys.argv[1]).read_metadata()\n"
    "sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)\n"
    "      for k, m in md.state_dict_metadata.items() if hasattr(m, 'chunks')}\n"
    "dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)",
)
# The readers' modules are imported before the clock starts (start-up, like importing torch: the
# command-line rows, whole process minus `fsdpcheck info`, include it).
READERS = (
    "import fsdpcheck.sources.torch_save, fsdpcheck.sources.safetensors_files, "
    "fsdpcheck.sources.dcp.source"
)
COMPARE = TIMED.format(
    imports="from fsdpcheck.comparison import compare_checkpoints\n" + READERS,
    work="r = compare_checkpoints(sys.argv[1], sys.argv[2], device=sys.argv[3])\n"
    "print([f.key for f in r.findings])",
)
FINGERPRINT = TIMED.format(
    imports="from fsdpcheck.fingerprints import fingerprint_checkpoint\n" + READERS,
    work="print(len(fingerprint_checkpoint(sys.argv[1])))",
)
AUDIT = TIMED.format(
    imports="from fsdpcheck.auditing import audit\n" + READERS,
    work="r = audit(sys.argv[1], deep=True)\nprint([f.key for f in r.findings])",
)
# The kernels alone over the same bytes already in memory: the floor on a machine where they,
# not the reads, are the slower part.
KERNEL_COMPARE = TIMED.format(
    imports="import torch\nfrom safetensors.torch import load_file\n"
    "from fsdpcheck.kernels import compare\n"
    "a = load_file(sys.argv[1]); b = load_file(sys.argv[2])\n"
    "xa = [t.add_(0) for t in a.values()]; xb = [t.add_(0) for t in b.values()]",
    work="compare(xa, xb, fingerprints=False)",
)
KERNEL_FINGERPRINT = TIMED.format(
    imports="import torch\nfrom safetensors.torch import load_file\n"
    "from fsdpcheck.kernels import fingerprint_tensors\n"
    "b = load_file(sys.argv[1]); xb = [t.add_(0) for t in b.values()]",
    work="fingerprint_tensors(xb)",
)
VERIFY = TIMED.format(
    imports="import torch\nfrom safetensors.torch import load_file\n"
    "from fsdpcheck.verification import verify\n" + READERS + "\n"
    "live = load_file(sys.argv[1])\n"
    "for t in live.values(): t.add_(0)  # resident, not lazily mapped",
    work="r = verify(live, sys.argv[2])\nprint([f.key for f in r.findings])",
)


PREAD = ["env", "FSDPCHECK_READ=pread"]

# As the console script runs it (`run`: main in its own process), on an older checkout (--src)
# `main`.
CLI = (
    "import sys\nimport fsdpcheck.cli as cli\n"
    "cli.run() if hasattr(cli, 'run') else sys.exit(cli.main(sys.argv[1:]))"
)


def _prefix(src: Path | None) -> str:
    """Code that makes a child import fsdpcheck from `src` (another checkout, for a baseline)."""
    if src is None:
        return ""
    return (
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
        f"type(f).__module__]\nsys.path.insert(0, {str(src)!r})\n"
    )


def measure(
    paths: dict[str, Path],
    reps: int,
    cold: bool,
    src: Path | None = None,
    device: str = "cpu",
    settle: float = 1.0,
) -> list[dict[str, Any]]:
    a, b, d = str(paths["a"]), str(paths["b"]), str(paths["dcp"])
    pre = _prefix(src)
    nb_st = paths["a"].stat().st_size + paths["b"].stat().st_size
    nb_dcp = sum(f.stat().st_size for f in _files(paths["dcp"]))
    fsd = [PY, "-c", pre + CLI]
    st, dc = [paths["a"], paths["b"]], [paths["dcp"]]
    fdd = (nb_dcp, dc, "d")
    rows: list[tuple[str, list[str], int, list[Path], str]] = [
        ("startup: fsdpcheck info", [*fsd, "info"], 0, [], ""),
        ("startup: import torch", [PY, "-c", "import torch, safetensors"], 0, [], ""),
        ("cat a b", ["cat", a, b], nb_st, st, ""),
        ("cat b_dcp", ["sh", "-c", f"cat {d}/* > /dev/null"], nb_dcp, dc, ""),
        # What people reach for to check or hash the same bytes (those installed).
        *[
            (name, ["sh", "-c", cmd], nbytes, files, kind)
            for name, cmd, nbytes, files, kind, tool in (
                ("cmp a b", f"cmp {a} {b} > /dev/null", nb_st, st, "c", "cmp"),
                ("xxh128sum b_dcp", f"xxh128sum {d}/* > /dev/null", nb_dcp, dc, "d", "xxh128sum"),
                ("b3sum b_dcp", f"b3sum {d}/* > /dev/null", nb_dcp, dc, "d", "b3sum"),
                ("sha256sum b_dcp", f"sha256sum {d}/* > /dev/null", nb_dcp, dc, "d", "sha256sum"),
            )
            if shutil.which(tool)
        ],
        ("naive: load_file+equal", [PY, "-c", NAIVE, a, b], nb_st, st, ""),
        ("naive: dcp.load", [PY, "-c", NAIVE_DCP, d], nb_dcp, dc, ""),
        ("kernel: compare in memory", [PY, "-c", pre + KERNEL_COMPARE, a, b], nb_st, [], "c"),
        ("kernel: fingerprint in memory", [PY, "-c", pre + KERNEL_FINGERPRINT, b], nb_dcp, [], "d"),
        ("fsdpcheck compare a b", [*fsd, "compare", a, b, "--device", device], nb_st, st, "c"),
        ("  compare_checkpoints()", [PY, "-c", pre + COMPARE, a, b, device], nb_st, st, "c"),
        ("fsdpcheck fingerprint b_dcp", [*fsd, "fingerprint", d], nb_dcp, dc, "d"),
        ("  fingerprint_checkpoint()", [PY, "-c", pre + FINGERPRINT, d], nb_dcp, dc, "d"),
        # The same without mapping files (byte-range reads into the arena): no SIGBUS exposure
        # at all, against the mapped path whose truncation safety is the guard's.
        ("  fingerprint_checkpoint() pread", [*PREAD, PY, "-c", pre + FINGERPRINT, d], *fdd),
        ("fsdpcheck audit --deep b_dcp", [*fsd, "audit", "--deep", d], nb_dcp, dc, "d"),
        ("  audit(deep=True)", [PY, "-c", pre + AUDIT, d], nb_dcp, dc, "d"),
        ("  verify(a tensors, b_dcp)", [PY, "-c", pre + VERIFY, a, d], nb_dcp, dc, "d"),
    ]
    results = []
    for mode in ("warm", "cold") if cold else ("warm",):
        todo = [row for row in rows if mode == "warm" or row[3]]
        if mode == "warm":
            # Warm means read from disk once, as a checkpoint that was copied or read before is:
            # pages a reader brings in are cached in large folios that map with one entry per
            # 2 MiB. Pages still cached from writing the files map per 4 KiB, which costs more
            # (a DCP fingerprint of 1.3 GB: 0.02 s more): evict them first so that every run
            # sees the same.
            _evict(st + dc)
            _run(["cat", *(str(f) for p in st + dc for f in _files(p))])
        for _, argv, _, _, _ in todo:
            _run(argv)  # warm-up (and, warm, fills the page cache)
        # Round-robin: each repetition runs every row once, so a slow spell of a shared machine
        # lands on all rows alike instead of on the one that happened to run then (the
        # command-line rows subtract the start-up row).
        runs: dict[str, list[tuple[float, float | None, int, str]]] = {r[0]: [] for r in todo}
        for _ in range(reps):
            for name, argv, _, files, _ in todo:
                # The kernel keeps working for a while after a process that held gigabytes
                # exits (seen here: the run right after `dcp.load` took 0.2-0.4 s longer
                # unless it waited 1 s), so each run waits first.
                time.sleep(settle)
                if mode == "cold":
                    _evict(files)
                runs[name].append(_run(argv))
        if mode == "warm":
            startup = [w for w, _, _, _ in runs["startup: fsdpcheck info"]]
        for name, _, nbytes, _, kind in todo:
            works = [k for _, k, _, _ in runs[name] if k is not None]
            if name.startswith("fsdpcheck "):
                # The work of a command: its whole process minus the start-up row of the same
                # round (warm; the rounds' start-ups otherwise), a difference per round, so that
                # one slow start-up does not move every command-line row.
                walls = [w for w, _, _, _ in runs[name]]
                if mode == "warm":
                    works = [w - s0 for w, s0 in zip(walls, startup)]
                else:
                    works = [w - statistics.median(startup) for w in walls]
            results.append(
                {
                    "mode": mode,
                    "name": name,
                    "bytes": nbytes,
                    "wall": statistics.median(w for w, _, _, _ in runs[name]),
                    "work": statistics.median(works) if works else None,
                    "rss": max(r for _, _, r, _ in runs[name]),
                    "kind": kind,
                }
            )
            print(f"# {mode} {name}: {results[-1]}", file=sys.stderr, flush=True)
    return results


def processor() -> str:
    """The CPU, as lscpu names it, and its core count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.uname().machine}, {os.cpu_count()} cores"


def table(results: list[dict[str, Any]]) -> str:
    by = {(r["mode"], r["name"]): r for r in results}
    lines = [f"# {processor()}"]
    for mode in sorted({r["mode"] for r in results}, reverse=True):
        start = by[("warm", "startup: fsdpcheck info")]["wall"]
        start_torch = by[("warm", "startup: import torch")]["wall"]
        cat = {"c": by[(mode, "cat a b")], "d": by[(mode, "cat b_dcp")]}
        naive = {"c": by[(mode, "naive: load_file+equal")], "d": by[(mode, "naive: dcp.load")]}
        lines.append(f"\n{mode} page cache (startup: fsdpcheck info {start:.2f} s, import torch "
                     f"{start_torch:.2f} s)")  # fmt: skip
        lines.append(
            f"{'command':32} {'whole s':>8} {'work s':>7} {'GB/s':>6} {'x cat':>6} "
            f"{'x naive':>7} {'RSS MB':>7}"
        )
        for r in results:
            if r["mode"] != mode:
                continue
            name = r["name"]
            work = r["work"] if r["work"] is not None else r["wall"]
            gbs = r["bytes"] / work / 1e9 if r["bytes"] and work > 0 else float("nan")
            k = r["kind"]
            xc = f"{work / cat[k]['wall']:.2f}" if k else ""
            nv = naive[k]["work"] if k else None
            xn = f"{work / nv:.2f}" if nv else ""
            lines.append(
                f"{name:32} {r['wall']:8.2f} {work:7.3f} {gbs:6.2f} {xc:>6} {xn:>7} "
                f"{r['rss'] / 2**20:7.0f}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=_size, default=int(1.3e9), help="bytes per file (1.3G)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="also time with the files evicted")
    ap.add_argument("--keep", type=Path, default=None, help="build (or reuse) the data here")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="where compare runs (cpu or cuda)")
    ap.add_argument(
        "--settle", type=float, default=1.0, help="seconds to wait before each timed run (1)"
    )
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--src",
        type=Path,
        default=None,
        help="time the fsdpcheck package in this folder instead (a baseline checkout whose "
        "fsdpcheck/ holds the built extension or a link to it)",
    )
    args = ap.parse_args()
    tmp = None
    if args.keep is not None:
        root = args.keep
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="fsdpcheck-offline-")
        root = Path(tmp)
    try:
        paths = {"a": root / "a.safetensors", "b": root / "b.safetensors", "dcp": root / "b_dcp"}
        if args.build_only:
            build(root, args.size)
            return
        if not all(p.exists() for p in paths.values()):
            # In a child: a child's peak RSS counts what it inherited from this process.
            t0 = time.perf_counter()
            cmd = [PY, __file__, "--build-only", "--keep", str(root), "--size", str(args.size)]
            subprocess.run(cmd, check=True)
            print(f"# built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        # Byte-compile the package first, as installing a wheel does: with
        # PYTHONDONTWRITEBYTECODE set (this machine sets it) every child would otherwise compile
        # fsdpcheck's modules again, ~40 ms that no installed copy pays.
        pkg = (args.src or Path(__file__).resolve().parents[1]) / "fsdpcheck"
        subprocess.run([PY, "-m", "compileall", "-q", str(pkg)], check=True)
        print(f"# load before: {os.getloadavg()}", file=sys.stderr)
        results = measure(paths, args.reps, args.cold, args.src, args.device, args.settle)
        print(f"# load after: {os.getloadavg()}", file=sys.stderr)
        print(table(results))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
