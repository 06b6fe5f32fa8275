"""The CUDA kernels read from their compiled code: registers, spills and the instructions each
element costs on the bit-equal path, and the H200 roofline that implies. No GPU needed.

It compiles ``csrc/cuda/compare_kernels.cu`` for sm_90 the way the extension builds it (nvcc,
C++20, -O3, the torch headers of the running Python), with ``-lineinfo`` (line tables only: the
code is the same) and ``-Xptxas -v``, disassembles the cubin with ``nvdisasm`` and prints, per
kernel:

- registers, stack frame, spill stores/loads and shared memory (ptxas), and the blocks (warps)
  per SM those allow;
- for the vector kernels (NOTE: [bit-equal fast path] in compare_kernels.h), the dynamic
  instruction count per element on the bit-equal path: the instructions of one pass through the
  main loop along that path, divided by the elements it handles, plus what a 65536-element chunk
  costs outside that loop (its prologue, the segment loop, the block reduction) spread over the
  chunk's elements;
- the roofline that count implies on an H200.

How the path is found: the control-flow graph of the kernel's SASS and its natural loops; the
main loop is the innermost loop holding the 16-byte loads of a round (source lines from the line
table); at each branch inside it with the work of a bit-equal vector (``fast_vector``) on one side
only, that side is taken; the bit-equal path is then the shortest cycle. Loops around it count
with their trip counts on a full chunk (segments per chunk, rounds per segment), entered once
each; the others (the per-element path, the tail) are not entered on that path. ``--before REV``
reports the one-kernel-per-chunk design this replaced the same way where it can (see
``chunk_kernel_path``).

The machine model (NVIDIA H200 SXM; stated, not measured): 132 SMs, 4 schedulers per SM, each
issuing one warp instruction per cycle at 1.98 GHz (3.34e13 thread instructions/s); the integer
ALU pipe (IADD3, LOP3, SHF, ISETP, SEL, PRMT, IMNMX, ...) and the FMA pipe (IMAD, FFMA, ...)
each take 16 lanes per scheduler per cycle (half a warp instruction per cycle), FP64 16 lanes,
conversions and MUFU 4 lanes; memory bandwidth 4233 GB/s (measured on the H200 reading a large
fp32 tensor). Elements per second = 132 * 4 * 1.98e9 * 32 / max(issue, 2 * ALU, 2 * FMA,
2 * FP64, 8 * XU) per element; the roofline is that rate against the bytes an element reads.

Usage::

    python bench/sass_report.py                 # compile, print the table
    python bench/sass_report.py --check         # also exit 1 on any spill or a missed target
    python bench/sass_report.py --json out.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS_CU = ROOT / "csrc" / "cuda" / "compare_kernels.cu"
KERNELS_H = ROOT / "csrc" / "cuda" / "compare_kernels.h"
DTYPES_H = ROOT / "csrc" / "fsdpcheck" / "dtypes.h"

# The machine (H200 SXM).
SMS = 132
SCHEDULERS = 4
CLOCK_HZ = 1.98e9
READ_BYTES_PER_S = 4233e9
ISSUE_PER_S = SMS * SCHEDULERS * CLOCK_HZ * 32  # thread instructions per second
MAX_WARPS_PER_SM = 64
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
CHUNK = 65536
THREADS = 256
SEGMENT = 32  # vectors per thread per segment (kSegment)
VEC_UNROLL = 2  # kVecUnroll


def dtype_codes(header: Path = DTYPES_H) -> dict[int, tuple[str, int]]:
    """DType code -> (name, bytes), read from the kernels' dtype table (its X(...) lines)."""
    row = re.compile(r'^\s*X\(\s*\w+\s*,\s*(\d+)\s*,\s*"(\w+)"\s*,\s*\w+\s*,\s*(\d+)\s*,', re.M)
    codes = {int(c): (name, int(size)) for c, name, size in row.findall(header.read_text())}
    if not codes:
        raise SystemExit(f"sass_report: no dtype table found in {header}")
    return codes


DTYPE_CODES = dtype_codes()
# The dtypes the report covers, and the kernel that fingerprints each size alone.
REPORTED = ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8"]
RAW_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

# Pipes, by opcode (the part before the first dot). Everything issues once; these also occupy a
# pipe narrower than a warp.
ALU = {
    "IADD3",
    "LOP3",
    "SHF",
    "ISETP",
    "SEL",
    "PRMT",
    "IMNMX",
    "VIMNMX",
    "LEA",
    "LEA.HI",
    "FLO",
    "POPC",
    "BREV",
    "IABS",
    "ISCADD",
    "PLOP3",
    "P2R",
    "R2P",
    "FSEL",
    "FSETP",
    "FMNMX",
    "BMSK",
    "SGXT",
    "LOP",
    "IADD",
    "SHL",
    "SHR",
    "CSET",
    "CSETP",
    "ICMP",
    "VABSDIFF",
    "VABSDIFF4",
}
FMA = {"IMAD", "IMUL", "FFMA", "FADD", "FMUL", "IDP", "IMADSP", "HFMA2", "HADD2", "HMUL2"}
FP64 = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX"}
XU = {"F2F", "I2F", "F2I", "MUFU", "I2I", "F2FP", "FRND"}
TARGETS = {
    # (mode, dtype): at most this many dynamic instructions per element on the bit-equal path.
    ("compare", "bfloat16"): 12.0,
    ("compare+fp", "bfloat16"): 31.0,
}
# Single-tensor fingerprint goal: 45% of read bandwidth on bfloat16.
FINGERPRINT_GOAL = 0.45


def find_tool(name: str) -> str:
    """A CUDA tool: the toolkit's (CUDA_HOME, CUDACXX, PATH, /usr/local/cuda), else pip's."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / name)
    if os.environ.get("CUDACXX"):
        candidates.append(Path(os.environ["CUDACXX"]).parent / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    candidates.append(Path("/usr/local/cuda/bin") / name)
    # The real toolkit behind an nvcc wrapper script (ENVIRONMENT.md).
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if Path(nvcc).exists():
        out = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
        m = re.search(r"#\$ TOP=(\S+)", out.stdout + out.stderr)
        if m:
            candidates.append(Path(m.group(1)) / "bin" / name)
    # pip: nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump put their binaries under nvidia/cu13/bin.
    site = Path(sysconfig.get_paths()["purelib"])
    candidates += sorted(site.glob(f"nvidia/*/bin/{name}")) + sorted(
        site.glob(f"nvidia/*/*/bin/{name}")
    )
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    hint = {"nvdisasm": "nvidia-cuda-nvdisasm", "cuobjdump": "nvidia-cuda-cuobjdump"}.get(name)
    raise SystemExit(
        f"sass_report: {name} not found (CUDA_HOME, PATH, /usr/local/cuda)"
        + (f"; `pip install {hint}` provides it" if hint else "")
    )


def torch_includes() -> list[str]:
    import torch.utils.cpp_extension as ext

    return list(ext.include_paths())


def compile_cubin(
    out: Path, arch: str, src: Path = ROOT / "csrc", extra: list[str] | None = None
) -> str:
    """Compiles compare_kernels.cu to a cubin; returns ptxas's -v report."""
    nvcc = find_tool("nvcc")
    cmd = [
        nvcc,
        "-std=c++20",
        "-O3",
        "-DNDEBUG",
        f"-arch=sm_{arch}",
        "-cubin",
        "-lineinfo",
        "-Xptxas",
        "-v",
        f"-I{src}",
        *(extra or []),
        "-o",
        str(out),
        str(src / "cuda" / "compare_kernels.cu"),
    ]
    for inc in torch_includes():
        cmd[1:1] = ["-isystem", inc]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit("sass_report: nvcc failed")
    return res.stdout + res.stderr


@dataclass
class Resources:
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0


def parse_ptxas(log: str) -> dict[str, Resources]:
    out: dict[str, Resources] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            current = m.group(1)
            out.setdefault(current, Resources())
            continue
        if current is None:
            continue
        r = out[current]
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            r.stack, r.spill_stores, r.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            r.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            r.smem = int(s.group(1)) if s else 0
    return out


@dataclass
class Instr:
    addr: int
    op: str  # opcode with modifiers
    text: str
    pred: str  # "" or the guard (@P0, @!P1, ...)
    target: int | None  # branch target
    lines: tuple[int, ...]  # source lines of compare_kernels.h (own, inlined-at)
    ew_lines: tuple[int, ...] = ()  # source lines of fsdpcheck/elementwise.h (own)

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Function:
    name: str
    instrs: list[Instr] = field(default_factory=list)


def disassemble(cubin: Path, header: Path = KERNELS_H) -> dict[str, Function]:
    nvdisasm = find_tool("nvdisasm")
    res = subprocess.run([nvdisasm, "-c", "-gi", str(cubin)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit("sass_report: nvdisasm failed: " + res.stderr)
    funcs: dict[str, Function] = {}
    f = None
    lines: tuple[int, ...] = ()
    ew_lines: tuple[int, ...] = ()
    header_name = "/".join(header.parts[-2:])  # cuda/compare_kernels.h
    for raw in res.stdout.splitlines():
        m = re.match(r"\.text\.(\w+):", raw.strip())
        if m:
            f = funcs.setdefault(m.group(1), Function(m.group(1)))
            continue
        if "//## File" in raw:
            found = re.findall(r'File "([^"]+)", line (\d+)|"([^"]+)", line (\d+)', raw)
            own, ew = [], []
            for a, b, c, d in found:
                path, ln = (a, b) if a else (c, d)
                if path.endswith(header_name):
                    own.append(int(ln))
                elif path.endswith("fsdpcheck/elementwise.h"):
                    ew.append(int(ln))
            lines, ew_lines = tuple(own), tuple(ew)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", raw)
        if not m or f is None:
            continue
        addr = int(m.group(1), 16)
        text = m.group(2).strip()
        pred = ""
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        op = text.split()[0]
        target = None
        if op.split(".")[0] in ("BRA", "BRX", "JMP", "CALL", "BSSY", "SSY", "PBK"):
            t = re.search(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
            if t and t.group(1):
                target = int(t.group(1), 16)
        f.instrs.append(Instr(addr, op, text, pred, target, lines, ew_lines))
    # nvdisasm names branch targets by label: map the labels to addresses.
    return resolve_labels(funcs, res.stdout) if "`(.L_x_" in res.stdout else funcs


def resolve_labels(funcs: dict[str, Function], text: str) -> dict[str, Function]:
    """Branch targets printed as labels (.L_x_N) become addresses."""
    label_addr: dict[str, dict[str, int]] = {}
    fname = None
    pending: list[str] = []
    for raw in text.splitlines():
        m = re.match(r"\.text\.(\w+):", raw.strip())
        if m:
            fname = m.group(1)
            label_addr[fname] = {}
            continue
        m = re.match(r"(\.L_x_\d+):", raw.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", raw)
        if m and fname is not None:
            for lab in pending:
                label_addr[fname][lab] = int(m.group(1), 16)
            pending = []
    for name, f in funcs.items():
        labels = label_addr.get(name, {})
        for ins in f.instrs:
            m = re.search(r"`\((\.L_x_\d+)\)", ins.text)
            if m and ins.base in ("BRA", "BRX", "JMP", "CALL", "BSSY"):
                ins.target = labels.get(m.group(1))
    return funcs


@dataclass
class Block:
    start: int
    instrs: list[Instr]
    succ: list[int] = field(default_factory=list)


def build_cfg(f: Function) -> dict[int, Block]:
    ins = f.instrs
    leaders = {ins[0].addr}
    for i, x in enumerate(ins):
        if x.base in ("BRA", "EXIT", "RET", "BRX", "JMP"):
            if i + 1 < len(ins):
                leaders.add(ins[i + 1].addr)
            if x.target is not None and x.base == "BRA":
                leaders.add(x.target)
    blocks: dict[int, Block] = {}
    cur: Block | None = None
    for x in ins:
        if x.addr in leaders:
            cur = Block(x.addr, [])
            blocks[x.addr] = cur
        assert cur is not None
        cur.instrs.append(x)
    order = sorted(blocks)
    for k, start in enumerate(order):
        b = blocks[start]
        last = b.instrs[-1]
        nxt = order[k + 1] if k + 1 < len(order) else None
        if last.base == "BRA":
            if last.target is not None:
                b.succ.append(last.target)
            if last.pred and nxt is not None:
                b.succ.append(nxt)
        elif last.base in ("EXIT", "RET"):
            if last.pred and nxt is not None:
                b.succ.append(nxt)
        elif last.base in ("BRX", "JMP"):
            pass  # indirect: not followed (the vector kernels have none)
        elif nxt is not None:
            b.succ.append(nxt)
    return blocks


def weight(b: Block) -> int:
    return sum(1 for x in b.instrs if x.base != "NOP")


@dataclass
class Loop:
    header: int
    body: set[int]


def natural_loops(blocks: dict[int, Block]) -> list[Loop]:
    preds: dict[int, list[int]] = {s: [] for s in blocks}
    for s, b in blocks.items():
        for t in b.succ:
            preds.setdefault(t, []).append(s)
    # Dominators would be exact; back edges by address order are what nvcc's layout gives.
    loops: dict[int, set[int]] = {}
    for s, b in blocks.items():
        for t in b.succ:
            if t <= s:
                body = loops.setdefault(t, {t})
                stack = [s]
                while stack:
                    n = stack.pop()
                    if n in body:
                        continue
                    body.add(n)
                    stack.extend(preds.get(n, []))
    return [Loop(h, body) for h, body in loops.items()]


def shortest(
    blocks: dict[int, Block],
    allowed: set[int],
    src: int,
    dst: int,
    cost: dict[int, int],
    first_free: bool = False,
) -> float:
    """Fewest instructions on a path src -> ... -> dst within `allowed` (src's cost included
    unless first_free; dst's cost included), moving along successor edges; dst may equal src
    only through at least one edge."""
    inf = float("inf")
    best: dict[int, float] = {}
    heap: list[tuple[float, int, bool]] = [(0 if first_free else cost[src], src, True)]
    while heap:
        d, n, is_start = heapq.heappop(heap)
        if n == dst and not is_start:
            return d - (cost[dst] if dst == src and not first_free else 0)
        key = n if not is_start else -1 - n
        if best.get(key, inf) <= d:
            continue
        best[key] = d
        for t in blocks[n].succ:
            if t in allowed:
                heapq.heappush(heap, (d + cost[t], t, False))
    return inf


@dataclass
class PathCount:
    per_element: float
    main_loop: int
    per_chunk_outside: float
    pipes: dict[str, float]


def source_lines(pattern: str) -> set[int]:
    """Lines of compare_kernels.h matching `pattern`."""
    return {
        i + 1
        for i, line in enumerate(KERNELS_H.read_text().splitlines())
        if re.search(pattern, line)
    }


def function_lines(signature: str, path: Path = KERNELS_H) -> set[int]:
    """The lines of the body of the function of `path` whose definition matches."""
    text = path.read_text().splitlines()
    for i, line in enumerate(text):
        if re.search(signature, line):
            for j in range(i, len(text)):
                if text[j] == "}":
                    return set(range(i + 1, j + 2))
    return set()


def fast_lines() -> set[int]:
    """Lines whose code is the work of a vector on the bit-equal path (NOTE: [bit-equal fast
    path]): the calls of fast_vector, its body, and the first-element update."""
    return source_lines(r"fast_vector<D, kFingerprints, kStats>\(x,") | function_lines(
        r"void fast_vector\("
    )


def slow_lines() -> set[int]:
    """Lines of compare_kernels.h that mark a vector as leaving the fast path."""
    return source_lines(r"\bslow \|= 1u <<")


def take_fast_branches(blocks: dict[int, Block], loop: Loop) -> None:
    """At a branch inside `loop` (not its latch) with the work of a bit-equal vector on one side
    only, keep that side."""
    fast = fast_lines()

    def has_fast(s: int) -> bool:
        return any(set(x.lines) & fast for x in blocks[s].instrs)

    for s in loop.body:
        b = blocks[s]
        if len(b.succ) == 2 and all(t in loop.body and t != loop.header for t in b.succ):
            sides = [has_fast(t) for t in b.succ]
            if sides[0] != sides[1]:
                b.succ = [t for t, f in zip(b.succ, sides) if f]


def pipe_of(op: str) -> str:
    base = op.split(".")[0]
    if base in FP64:
        return "fp64"
    if base in XU:
        return "xu"
    if base in FMA:
        return "fma"
    if base in ALU:
        return "alu"
    return "other"


def bit_equal_path(f: Function, elem_size: int) -> PathCount | None:
    """Dynamic instructions per element of a full chunk on the bit-equal path of a vector kernel."""
    blocks = build_cfg(f)
    loops = natural_loops(blocks)

    def count(loop: Loop, prefix: str) -> int:
        return sum(1 for s in loop.body for x in blocks[s].instrs if x.op.startswith(prefix))

    if not loops or max(count(lp, "LDG.E.128") for lp in loops) == 0:
        return None
    # The innermost loop holding the loads of the rounds of kVecUnroll vectors.
    round_loads = source_lines(r"va\[u\] = load_vec\(")
    loading = [
        lp
        for lp in loops
        if any(
            x.op.startswith("LDG.E.128") and set(x.lines) & round_loads
            for s in lp.body
            for x in blocks[s].instrs
        )
    ]
    if not loading:
        return None
    main = min(loading, key=lambda lp: len(lp.body))
    take_fast_branches(blocks, main)
    marks = slow_lines()

    # Blocks that only mark vectors as slow (every instruction but branches from such a line).
    def marks_slow(b: Block) -> bool:
        work = [x for x in b.instrs if x.base not in ("BRA", "NOP")]
        return bool(work) and all(set(x.lines) & marks for x in work)

    excluded = {s for s, b in blocks.items() if marks_slow(b)}
    cost = {s: weight(b) for s, b in blocks.items()}
    cycle = shortest(blocks, main.body - excluded, main.header, main.header, cost)
    pipes: dict[str, float] = {}
    for s in cycle_blocks(blocks, main.body - excluded, main.header, cost):
        for x in blocks[s].instrs:
            if x.base != "NOP":
                pipes[pipe_of(x.op)] = pipes.get(pipe_of(x.op), 0) + 1
    kv = 16 // elem_size
    vectors_per_thread = CHUNK // kv // THREADS
    segments = max(1, vectors_per_thread // SEGMENT)
    rounds = min(SEGMENT, vectors_per_thread) // VEC_UNROLL
    enclosing = sorted((lp for lp in loops if main.body < lp.body), key=lambda lp: len(lp.body))
    chunk_loop = next((lp for lp in enclosing if count(lp, "BAR") > 0), None)
    segment_loop = next((lp for lp in enclosing if count(lp, "BAR") == 0), None)

    def once(outer: Loop, inner: Loop) -> float:
        """One bit-equal pass of `outer` through `inner` (whose own instructions count as 0)."""
        c2 = dict(cost)
        for s in inner.body:
            c2[s] = 0
        allowed = outer.body - excluded
        return (
            shortest(blocks, allowed, outer.header, inner.header, c2)
            + shortest(blocks, allowed, inner.header, outer.header, c2, first_free=True)
            - (c2[outer.header] if outer.header == inner.header else 0)
        )

    outside = 0.0
    inner = main
    if segment_loop is not None and (chunk_loop is None or segment_loop.body < chunk_loop.body):
        outside += segments * once(segment_loop, main)
        inner = segment_loop
    if chunk_loop is not None:
        outside += once(chunk_loop, inner)
    per_iter = VEC_UNROLL * kv
    per_element = (cycle * rounds * segments + outside) / (CHUNK // THREADS)
    return PathCount(per_element, int(cycle), outside, {p: n / per_iter for p, n in pipes.items()})


def cycle_blocks(
    blocks: dict[int, Block], allowed: set[int], header: int, cost: dict[int, int]
) -> list[int]:
    inf = float("inf")
    dist: dict[int, float] = {}
    prev: dict[int, int] = {}
    heap = [(cost[header], header)]
    dist[header] = cost[header]
    done: set[int] = set()
    end_prev = None
    end_d = inf
    while heap:
        d, n = heapq.heappop(heap)
        if n in done:
            continue
        done.add(n)
        for t in blocks[n].succ:
            if t not in allowed:
                continue
            if t == header:
                if d < end_d:
                    end_d, end_prev = d, n
                continue
            nd = d + cost[t]
            if nd < dist.get(t, inf):
                dist[t] = nd
                prev[t] = n
                heapq.heappush(heap, (nd, t))
    out = []
    n = end_prev
    while n is not None and n != header:
        out.append(n)
        n = prev.get(n)
    out.append(header)
    return out


@dataclass
class Kernel:
    name: str  # readable
    kind: str  # vector / general / finish / chunk (the one-kernel-per-chunk design)
    dtype: str | None
    mode: str  # compare, compare+fp, compare+stats, compare+fp+stats, fingerprint
    res: Resources
    path: PathCount | None = None


def describe(mangled: str) -> tuple[str, str, str | None, str]:
    m = re.search(r"vector_kernelILNS_5DTypeE(\d+)ELb([01])ELb([01])ELb([01])E", mangled)
    if m:
        code, has_e, fp, stats = (int(g) for g in m.groups())
        dtype = DTYPE_CODES[code][0]
        if not has_e:
            mode = "fingerprint"
        else:
            mode = "compare" + ("+fp" if fp else "") + ("+stats" if stats else "")
        return f"vector<{dtype}, {mode}>", "vector", dtype, mode
    m = re.search(r"(general|chunk)_kernelILb([01])ELb([01])E", mangled)
    if m:
        kind, has_e, fp = m.group(1), int(m.group(2)), int(m.group(3))
        mode = "fingerprint" if not has_e else ("compare+fp" if fp else "compare")
        return f"{kind}<{mode}>", kind, None, mode
    if "finish_kernel" in mangled:
        return "finish", "finish", None, "-"
    return mangled, "other", None, "-"


def warps_per_sm(r: Resources, threads: int = THREADS) -> int:
    regs = max(r.registers, 1)
    per_thread_regs = (regs + 7) // 8 * 8
    by_regs = REGS_PER_SM // (per_thread_regs * threads)
    by_smem = SMEM_PER_SM // r.smem if r.smem else 32
    blocks = min(by_regs, by_smem, MAX_WARPS_PER_SM * 32 // threads)
    return blocks * threads // 32


def roofline(
    per_element: float, pipes: dict[str, float], bytes_per_element: int
) -> tuple[float, float]:
    """(issue-bound fraction of read bandwidth, pipe-bound fraction), both capped at 1."""
    bw_rate = READ_BYTES_PER_S / bytes_per_element
    issue_rate = ISSUE_PER_S / per_element
    cycles = max(
        per_element,
        2 * pipes.get("alu", 0.0),
        2 * pipes.get("fma", 0.0),
        2 * pipes.get("fp64", 0.0),
        8 * pipes.get("xu", 0.0),
    )
    pipe_rate = ISSUE_PER_S / cycles
    return min(1.0, issue_rate / bw_rate), min(1.0, pipe_rate / bw_rate)


def analyse(cubin: Path, ptxas: str) -> list[Kernel]:
    resources = parse_ptxas(ptxas)
    funcs = disassemble(cubin)
    kernels = []
    for mangled, f in funcs.items():
        name, kind, dtype, mode = describe(mangled)
        k = Kernel(name, kind, dtype, mode, resources.get(mangled, Resources()))
        if kind == "vector" and dtype is not None:
            k.path = bit_equal_path(f, dict(DTYPE_CODES.values())[dtype])
        kernels.append(k)
    return kernels


def rows_for_report(kernels: list[Kernel]) -> list[dict]:
    rows = []
    for k in sorted(kernels, key=lambda k: (k.kind, k.mode, k.dtype or "")):
        row = {
            "kernel": k.name,
            "registers": k.res.registers,
            "stack": k.res.stack,
            "spill_stores": k.res.spill_stores,
            "spill_loads": k.res.spill_loads,
            "smem": k.res.smem,
            "warps_per_sm": warps_per_sm(k.res),
        }
        if k.path is not None and k.dtype is not None:
            size = dict(DTYPE_CODES.values())[k.dtype]
            read = size * (1 if k.mode == "fingerprint" else 2)
            issue, pipe = roofline(k.path.per_element, k.path.pipes, read)
            row.update(
                dtype=k.dtype,
                mode=k.mode,
                per_element=round(k.path.per_element, 2),
                main_loop=k.path.main_loop,
                per_chunk_outside=k.path.per_chunk_outside,
                pipes={p: round(v, 2) for p, v in sorted(k.path.pipes.items())},
                roofline_issue=round(issue, 3),
                roofline_pipes=round(pipe, 3),
            )
        rows.append(row)
    return rows


def print_report(rows: list[dict]) -> None:
    print(
        f"# H200 model: {SMS} SMs x {SCHEDULERS} schedulers x {CLOCK_HZ / 1e9:.2f} GHz = "
        f"{ISSUE_PER_S:.3g} thread instructions/s issued; ALU and FMA pipes half a warp per "
        f"cycle each, FP64 half, conversions 1/8; reads {READ_BYTES_PER_S / 1e9:.0f} GB/s"
    )
    print(f"{'kernel':44s} {'regs':>4s} {'stack':>5s} {'spill':>9s} {'smem':>6s} {'warps/SM':>8s}")
    for r in rows:
        print(
            f"{r['kernel']:44s} {r['registers']:4d} {r['stack']:5d} "
            f"{r['spill_stores']:4d}/{r['spill_loads']:<4d} {r['smem']:6d} {r['warps_per_sm']:8d}"
        )
    print()
    print(
        "# bit-equal path of a full 65536-element chunk: dynamic instructions per element (a pair "
        "when comparing), the main loop's length, its pipe mix per element, the H200 roofline"
    )
    print(
        f"{'dtype':14s} {'mode':18s} {'instr/elem':>10s} {'loop':>5s} {'alu':>5s} {'fma':>5s} "
        f"{'fp64':>5s} {'xu':>5s} {'roofline (issue)':>16s} {'(pipes)':>8s}"
    )
    for r in rows:
        if "per_element" not in r or r["dtype"] not in REPORTED + list(RAW_OF_SIZE.values()):
            continue
        if r["mode"] == "fingerprint" and r["dtype"] not in RAW_OF_SIZE.values():
            continue
        p = r["pipes"]
        dtype = r["dtype"]
        if r["mode"] == "fingerprint":
            dtype = f"any {dict(DTYPE_CODES.values())[dtype]}-byte"
        elif dtype not in REPORTED:
            continue
        print(
            f"{dtype:14s} {r['mode']:18s} {r['per_element']:10.2f} {r['main_loop']:5d} "
            f"{p.get('alu', 0):5.2f} {p.get('fma', 0):5.2f} {p.get('fp64', 0):5.2f} "
            f"{p.get('xu', 0):5.2f} {100 * r['roofline_issue']:15.0f}% "
            f"{100 * r['roofline_pipes']:7.0f}%"
        )


def check(rows: list[dict]) -> list[str]:
    problems = []
    for r in rows:
        if r["spill_stores"] or r["spill_loads"]:
            problems.append(f"{r['kernel']}: spills {r['spill_stores']}/{r['spill_loads']} bytes")
        if r["kernel"].startswith("vector<") and r["warps_per_sm"] < 32:
            problems.append(f"{r['kernel']}: {r['warps_per_sm']} warps per SM (< 32)")
    by = {(r.get("mode"), r.get("dtype")): r for r in rows if "per_element" in r}
    for (mode, dtype), limit in TARGETS.items():
        r = by.get((mode, dtype))
        if r is None:
            problems.append(f"no {mode} kernel for {dtype} found")
        elif r["per_element"] > limit:
            problems.append(
                f"{mode} {dtype}: {r['per_element']:.1f} instructions per element > {limit}"
            )
    fp = by.get(("fingerprint", "int16"))
    if fp is None:
        problems.append("no 2-byte fingerprint kernel found")
    elif fp["roofline_issue"] < FINGERPRINT_GOAL:
        problems.append(
            f"2-byte fingerprint: {100 * fp['roofline_issue']:.0f}% of read bandwidth by issue "
            "rate "
            f"< {100 * FINGERPRINT_GOAL:.0f}%"
        )
    return problems


def longest_cycle_blocks(
    blocks: dict[int, Block], allowed: set[int], header: int, cost: dict[int, int]
) -> list[int]:
    """The blocks of the longest path header -> ... -> header within `allowed` (acyclic once the
    edges back to the header are cut; inner loops, if any, are not followed around)."""
    order: list[int] = []
    seen: set[int] = set()

    def visit(n: int) -> None:  # reverse post-order of the DAG below the header
        seen.add(n)
        for t in blocks[n].succ:
            if t in allowed and t != header and t not in seen and t > n:
                visit(t)
        order.append(n)

    visit(header)
    order.reverse()
    best = {header: cost[header]}
    prev: dict[int, int] = {}
    end, end_d = None, -1.0
    for n in order:
        if n not in best:
            continue
        for t in blocks[n].succ:
            if t == header:
                if best[n] > end_d:
                    end, end_d = n, best[n]
            elif t in allowed and t > n and best[n] + cost[t] > best.get(t, -1):
                best[t] = best[n] + cost[t]
                prev[t] = n
    out = []
    while end is not None:
        out.append(end)
        end = prev.get(end)
    return out


def longest_cycle(
    blocks: dict[int, Block], allowed: set[int], header: int, cost: dict[int, int]
) -> float:
    return float(sum(cost[s] for s in longest_cycle_blocks(blocks, allowed, header, cost)))


def chunk_kernel_path(f: Function, elem_size: int, elementwise: Path) -> PathCount | None:
    """The bit-equal path of the one-block-per-chunk kernel this report replaced (``--before``):
    the longest cycle of its vector loop (16-byte loads) once the code off that path is taken out
    (the comparison of different bits, the statistics, the update of a maximum: lines of
    elementwise.h), and the shortest way from the entry to an exit around it."""
    blocks = build_cfg(f)
    loops = natural_loops(blocks)

    def count(loop: Loop) -> int:
        return sum(
            1
            for s in loop.body
            for x in blocks[s].instrs
            if ".128" in x.op and x.op.startswith("LD")
        )

    loading = [lp for lp in loops if count(lp) > 0]
    if not loading:
        return None
    innermost = [lp for lp in loading if not any(o.body < lp.body for o in loading)]
    main = max(innermost, key=count)
    cost = {s: weight(b) for s, b in blocks.items()}
    # Off the bit-equal path: the pair of different bits, the statistics, a new maximum.
    off = set()
    for sig in (
        r"void accumulate_pair\(",
        r"ElementResult compare_values\(",
        r"void accumulate_stats\(",
        r"Value decode\(",
        r"double minifloat_to_f64\(",
    ):
        off |= function_lines(sig, elementwise)
    off |= {
        i + 1
        for i, line in enumerate(elementwise.read_text().splitlines())
        if re.fullmatch(r"\s+(v = cv;|idx = cidx;)", line)
    }
    allowed = {s for s in main.body if not any(set(x.ew_lines) & off for x in blocks[s].instrs)}
    cycle = longest_cycle(blocks, allowed, main.header, cost)
    c2 = dict(cost)
    for s in main.body:
        c2[s] = 0
    everything = set(blocks)
    entry = min(blocks)
    exits = [s for s, b in blocks.items() if b.instrs[-1].base == "EXIT" and not b.instrs[-1].pred]
    outside = shortest(blocks, everything, entry, main.header, c2) if entry != main.header else 0
    outside += min(
        (shortest(blocks, everything, main.header, x, c2, first_free=True) for x in exits),
        default=0.0,
    )
    pipes: dict[str, float] = {}
    for s in longest_cycle_blocks(blocks, allowed, main.header, cost):
        for x in blocks[s].instrs:
            if x.base != "NOP":
                pipes[pipe_of(x.op)] = pipes.get(pipe_of(x.op), 0) + 1
    kv = 16 // elem_size
    per_iter = VEC_UNROLL * kv
    rounds = CHUNK // kv // THREADS // VEC_UNROLL
    per_element = (cycle * rounds + outside) / (CHUNK // THREADS)
    return PathCount(per_element, int(cycle), outside, {p: n / per_iter for p, n in pipes.items()})


def analyse_before(rev: str, arch: str) -> list[dict]:
    """The kernels of revision `rev` (one chunk kernel for every dtype), compiled once per
    reported dtype with visit_dtype fixed to it, so that each cubin holds that dtype's loop."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "csrc"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        src = Path(tmp) / "csrc"
        ew = src / "fsdpcheck" / "elementwise.h"
        text = ew.read_text()
        anchor = "FSDPCHECK_HD auto visit_dtype(DType d, F&& f) {\n"
        if anchor not in text:
            raise SystemExit(f"sass_report: {rev}'s visit_dtype is not the one --before knows")
        ew.write_text(
            text.replace(
                anchor,
                anchor + "#ifdef FSDPCHECK_SASS_DTYPE\n"
                "  d = static_cast<DType>(FSDPCHECK_SASS_DTYPE);\n#endif\n",
            )
        )
        codes = {name: code for code, (name, _) in DTYPE_CODES.items()}
        for dtype in REPORTED:
            cubin = Path(tmp) / f"{dtype}.cubin"
            ptxas = compile_cubin(cubin, arch, src, [f"-DFSDPCHECK_SASS_DTYPE={codes[dtype]}"])
            resources = parse_ptxas(ptxas)
            size = dict(DTYPE_CODES.values())[dtype]
            for mangled, f in disassemble(cubin, src / "cuda" / "compare_kernels.h").items():
                name, kind, _, mode = describe(mangled)
                if kind != "chunk":
                    continue
                path = chunk_kernel_path(f, size, src / "fsdpcheck" / "elementwise.h")
                if path is None:
                    continue
                read = size * (1 if mode == "fingerprint" else 2)
                issue, pipe = roofline(path.per_element, path.pipes, read)
                r = resources.get(mangled, Resources())
                rows.append(
                    dict(
                        kernel=f"{name} ({dtype})",
                        dtype=dtype,
                        mode=mode,
                        registers=r.registers,
                        stack=r.stack,
                        spill_stores=r.spill_stores,
                        spill_loads=r.spill_loads,
                        smem=r.smem,
                        warps_per_sm=warps_per_sm(r),
                        per_element=round(path.per_element, 2),
                        main_loop=path.main_loop,
                        per_chunk_outside=path.per_chunk_outside,
                        pipes={p: round(v, 2) for p, v in sorted(path.pipes.items())},
                        roofline_issue=round(issue, 3),
                        roofline_pipes=round(pipe, 3),
                    )
                )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="SM architecture (default 90)")
    ap.add_argument("--cubin", type=Path, help="analyse this cubin (with --ptxas-log) instead")
    ap.add_argument("--ptxas-log", type=Path, help="ptxas -v output of --cubin")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--check", action="store_true", help="exit 1 on a spill or a missed target")
    ap.add_argument(
        "--before", metavar="REV", help="also report the kernels of git revision REV (lower bounds)"
    )
    args = ap.parse_args()
    if args.before:
        before = analyse_before(args.before, args.arch)
        print(
            f"# {args.before}: the chunk kernel (one block per chunk, every dtype in one "
            "kernel), bit-equal path, statistics off"
        )
        print(
            f"{'kernel':40s} {'regs':>4s} {'spill':>9s} {'warps/SM':>8s} {'instr/elem':>10s} "
            f"{'loop':>5s} {'roofline (issue)':>16s} {'(pipes)':>8s}"
        )
        for r in before:
            print(
                f"{r['kernel']:40s} {r['registers']:4d} "
                f"{r['spill_stores']:4d}/{r['spill_loads']:<4d} "
                f"{r['warps_per_sm']:8d} {r['per_element']:10.2f} {r['main_loop']:5d} "
                f"{100 * r['roofline_issue']:15.0f}% {100 * r['roofline_pipes']:7.0f}%"
            )
        print()
    with tempfile.TemporaryDirectory() as tmp:
        if args.cubin:
            cubin, ptxas = args.cubin, args.ptxas_log.read_text() if args.ptxas_log else ""
        else:
            cubin = Path(tmp) / "compare_kernels.cubin"
            ptxas = compile_cubin(cubin, args.arch)
        rows = rows_for_report(analyse(cubin, ptxas))
    print_report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    problems = check(rows)
    for p in problems:
        print("sass_report: " + p, file=sys.stderr)
    if args.check and problems:
        return 1
    print("sass_report: no spills; targets met" if not problems else "sass_report: see above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
