"""Sentinels: elements a load never wrote.

Before a load, every local destination is filled with a value no load writes by accident (a NaN
with a recognisable payload, or the integer minimum); afterwards, elements still holding it were
never written.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.dist.runner import Call
from fsdpcheck.layout import local_layout
from fsdpcheck.live import flat_live
from fsdpcheck.report import Finding

# The sentinel of each kernel dtype, written through an integer view of the same size. bool has
# none: every byte of a bool tensor must be 0 or 1 (anything else is undefined in torch), and both
# are values a load writes. tests/unit/test_dtype_table.py holds the keys to the compiled dtype
# table.
_SENTINEL_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF80000BAD1BAD1),
    torch.float32: (torch.int32, 0x7FC0BAD1),
    torch.bfloat16: (torch.int16, 0x7FBA),
    torch.float16: (torch.int16, 0x7EBA),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7E),
    torch.int64: (torch.int64, -(2**63)),
    torch.int32: (torch.int32, -(2**31)),
    torch.int16: (torch.int16, -(2**15)),
    torch.int8: (torch.int8, -(2**7)),
    torch.uint8: (torch.uint8, 0xFF),
}


def fill_sentinel(model: Any, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """Fills every local destination with its dtype's sentinel; the filled tensors by key."""
    marked = []
    for key, value in sorted(flat_live(model, optimizer).items()):
        for piece in local_layout(value).pieces:
            t = piece.tensor
            if t.dtype in _SENTINEL_BITS and t.numel() > 0:
                view_dtype, bits = _SENTINEL_BITS[t.dtype]
                with torch.no_grad():
                    t.view(view_dtype).fill_(bits)
                marked.append((key, t))
    return marked


def unwritten(marked: list[tuple[str, torch.Tensor]], call: Call) -> list[Finding]:
    """Findings for keys with elements that still hold the sentinel (summed over ranks).

    Collective (an agreement of `call`, then one all-reduce of one word per key).
    """
    local: dict[str, int] = {}
    for key, t in marked:
        view_dtype, bits = _SENTINEL_BITS[t.dtype]
        n = int((t.view(view_dtype) == torch.tensor(bits, dtype=view_dtype)).sum())
        if n:
            local[key] = local.get(key, 0) + n
    # The job's keys (pipeline stages mark different ones), then one summed row per key: no
    # per-rank data travels (NOTE: [bytes per rank] in collectives).
    groups, past = call.gather("finding what the load never wrote", sorted({k for k, _ in marked}))
    universe = sorted(set().union(*(g.payload for g in groups)))
    row = torch.tensor([local.get(k, 0) for k in universe], dtype=torch.int64)
    summed = call.comm.all_reduce(row, dist.ReduceOp.SUM).tolist()
    counts = {k: n for k, n in zip(universe, summed) if n}
    findings = []
    if past:
        findings.append(
            Finding("*", "error", f"ranks {past[:8]} marked keys not counted here", ranks=past)
        )
    return findings + [
        Finding(
            key,
            "missing",
            f"{n} element(s) were never written by the load (they still hold the sentinel)",
            mismatched=n,
        )
        for key, n in sorted(counts.items())
    ]
