"""Findings and reports: the same on every rank, readable like torch.testing.assert_close."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# Finding kinds, in the order a report lists them for one key.
KINDS = (
    "missing",
    "unexpected",
    "shape",
    "dtype",
    "requires_grad",
    "layout",
    "value",
    "replica",
    "error",
)


class VerificationError(AssertionError):
    """Raised by ``Report.raise_if_failed``; its message is the report."""


@dataclass
class Finding:
    """One thing that is wrong.

    Attributes:
        key: The live key (model FQN, or ``optim.state.<fqn>.<name>`` /
            ``optim.param_groups.<i>.<name>`` for the optimizer).
        kind: One of "value", "missing", "unexpected", "shape", "dtype", "requires_grad",
            "layout", "replica" (copies that should agree do not) or "error".
        message: What is wrong and what to do, in words.
        mismatched: Mismatched elements (value findings).
        numel: Elements compared for this key, over all ranks.
        max_abs_diff: Greatest absolute difference.
        max_abs_index: Its GLOBAL index.
        rank: The rank holding that element (or the rank an error happened on).
        max_rel_diff: Greatest relative difference.
        max_rel_index: Its global index.
        rel_rank: The rank holding it.
        atol: Absolute tolerance used.
        rtol: Relative tolerance used.
        ranks: Ranks involved, where more than one is (errors, replicas).
    """

    key: str
    kind: str
    message: str = ""
    mismatched: int = 0
    numel: int = 0
    max_abs_diff: float | None = None
    max_abs_index: tuple[int, ...] | None = None
    rank: int | None = None
    max_rel_diff: float | None = None
    max_rel_index: tuple[int, ...] | None = None
    rel_rank: int | None = None
    atol: float = 0.0
    rtol: float = 0.0
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")

    def describe(self) -> str:
        """The finding in the words of torch.testing.assert_close, with global indices."""
        head = f"[{self.kind}] {self.key}"
        if self.kind != "value":
            return f"{head}: {self.message}"
        pct = 100.0 * self.mismatched / self.numel if self.numel else 0.0
        lines = [head + (f": {self.message}" if self.message else "")]
        lines.append(f"  Mismatched elements: {self.mismatched} / {self.numel} ({pct:.1f}%)")
        if self.max_abs_index is not None:
            lines.append(
                f"  Greatest absolute difference: {self.max_abs_diff} at index "
                f"{self.max_abs_index}{_on(self.rank)} (up to {self.atol} allowed)"
            )
        if self.max_rel_index is not None:
            lines.append(
                f"  Greatest relative difference: {self.max_rel_diff} at index "
                f"{self.max_rel_index}{_on(self.rel_rank)} (up to {self.rtol} allowed)"
            )
        return "\n".join(lines)


@dataclass
class Report:
    """The verdict of a verification, identical on every rank.

    Attributes:
        findings: Everything wrong, sorted by key then kind.
        reference: What the live state was checked against.
        world_size: Ranks that took part.
        keys_checked: Live keys checked.
        elements_checked: Elements compared, over all ranks.
        bytes_read: Reference bytes read, over all ranks.
        seconds: Wall time of the slowest rank.
        notes: Things worth knowing that are not failures (e.g. a fallback taken).
    """

    findings: list[Finding] = field(default_factory=list)
    reference: str = ""
    world_size: int = 1
    keys_checked: int = 0
    elements_checked: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when there is no finding."""
        return not self.findings

    def by_kind(self, kind: str) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (tuples become lists, infinities become strings)."""
        d = asdict(self)
        d["ok"] = self.ok
        return _json_safe(d)

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON."""
        return json.dumps(self.to_dict(), **kwargs)

    def summary(self) -> str:
        """One line: verdict and what was checked."""
        verdict = "OK" if self.ok else f"FAILED with {len(self.findings)} finding(s)"
        what = f"{self.keys_checked} keys"
        if self.elements_checked:
            what += f", {self.elements_checked:,} elements"
        if self.world_size > 1:
            what += f" on {self.world_size} ranks"
        read = f"{self.bytes_read / 1e6:,.1f} MB read in " if self.bytes_read else ""
        return f"fsdpcheck: {verdict}: {what} against {self.reference}; {read}{self.seconds:.2f} s"

    def __str__(self) -> str:
        parts = [self.summary()]
        parts += [f.describe() for f in self.findings]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)

    def raise_if_failed(self) -> None:
        """Raises VerificationError with the report's text when there is any finding."""
        if not self.ok:
            raise VerificationError(str(self))


def _on(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    return x
