"""The job's key set: what the ranks hold, agreed with O(keys) bytes per rank.

Ranks of a pipeline-parallel job hold different keys (each stage its layers); every other job
holds the same keys on every rank. ``agree_keys`` gives every rank the same merged view either
way: when every rank's names digest the same (one all-reduce of 4 words), its own names are
the job's; otherwise each distinct list travels once (``collectives.distinct``) and the union is
taken, in the order of the lowest rank holding each list. Ranks that disagree about a key they
both hold (its global shape or dtype) are named. It is the first agreement of verify and of the
fingerprint pass (``dist.runner``): a failure on any rank, or arguments that differ, end the call
there on every rank with the same ``RankFailure``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpcheck._collector import paused
from fsdpcheck.dist.runner import Call
from fsdpcheck.layout import Meta
from fsdpcheck.live import LiveState
from fsdpcheck.report import Finding


@dataclass
class KeySet:
    """What the ranks agreed on.

    Attributes:
        live: The job's names (values are ``Meta``): the union over the ranks.
        findings: Keys the ranks hold with different global shapes or dtypes.
        stages: Distinct sets of key names in the job (1 unless pipeline stages differ).
        partial: Keys that not every rank holds -> the lowest rank holding them (to name it).
    """

    live: LiveState
    findings: list[Finding] = field(default_factory=list)
    stages: int = 1
    partial: dict[str, int] = field(default_factory=dict)


@paused()  # NOTE: [collector]: objects per key
def agree_keys(call: Call, live: LiveState | None) -> KeySet:
    """Agrees on the job's live names across ranks (an agreement of `call`).

    Args:
        call: The call (its failure and arguments, if any, travel too).
        live: This rank's live state (None when reading it failed: `call` holds why).

    Returns:
        The KeySet, identical on every rank.

    Raises:
        RankFailure: On every rank, when any rank failed before, or the arguments differ.
    """
    names = call.local(
        "reading the live state", lambda: live.names_only() if live is not None else LiveState()
    )
    groups = call.exchange("agreeing on the keys", names)
    merged, conflicts = _union([(g.ranks, g.payload) for g in groups])
    sets = [(g.ranks[0], set(g.payload.tensors()) | set(g.payload.buffers)) for g in groups]
    partial: dict[str, int] = {}
    if len(sets) > 1:
        everywhere = set.intersection(*(held for _, held in sets))
        for first, held in sets:
            for n in held - everywhere:
                partial.setdefault(n, first)
    stages = len({frozenset(held) for _, held in sets})
    return KeySet(merged, findings=conflicts, stages=stages, partial=partial)


def _union(views: list[tuple[list[int], LiveState]]) -> tuple[LiveState, list[Finding]]:
    """The union of the ranks' names; keys held with different metas are findings."""
    if len(views) == 1:
        return views[0][1], []
    out = LiveState()
    seen: dict[str, tuple[Meta, list[int]]] = {}
    findings: list[Finding] = []
    groups = [v.param_groups for _, v in views]
    for ranks, v in views:
        for target, source in ((out.model, v.model), (out.buffers, v.buffers)):
            for k, meta in source.items():
                _put(target, k, meta, ranks, seen, findings)
        out.tied.update(v.tied)
        out.adapters = tuple(dict.fromkeys(out.adapters + v.adapters))
        if v.optim_state is not None:
            if out.optim_state is None:
                out.optim_state = {}
            for fqn, states in v.optim_state.items():
                mine = out.optim_state.setdefault(fqn, {})
                for name, meta in states.items():
                    _put(mine, name, meta, ranks, seen, findings, key=f"optim.state.{fqn}.{name}")
    # The parameter order maps integer optimizer ids; it is the job's only if every rank has it.
    out.param_groups = groups[0] if all(g == groups[0] for g in groups) else None
    return out, findings


def _put(
    target: dict[str, Any],
    k: str,
    meta: Any,
    ranks: list[int],
    seen: dict[str, tuple[Meta, list[int]]],
    findings: list[Finding],
    key: str | None = None,
) -> None:
    name = key or k
    if name in seen and seen[name][0] != meta:
        first, where = seen[name]
        kind = "shape" if first.shape != meta.shape else "dtype"
        findings.append(
            Finding(
                name,
                kind,
                f"ranks disagree about it: ranks {where[:8]} hold {first.shape} {first.dtype}, "
                f"ranks {ranks[:8]} hold {meta.shape} {meta.dtype}",
                ranks=sorted(where + ranks),
            )
        )
        return
    seen.setdefault(name, (meta, ranks))
    target.setdefault(k, meta)


__all__ = ["KeySet", "agree_keys"]
