"""Findings and reports: the same on every rank, readable like torch.testing.assert_close."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdpcheck.errors import VerificationError as VerificationError
from fsdpcheck.errors import describe_error as describe_error
from fsdpcheck.errors import root_cause as root_cause
from fsdpcheck.errors import shown

# Finding kinds, in the order a report lists them for one key.
KINDS = (
    "missing",
    "unexpected",
    "shape",
    "dtype",
    "requires_grad",
    "layout",
    "gap",
    "skipped",
    "value",
    "replica",
    "error",
)
_ORDER = {k: i for i, k in enumerate(KINDS)}
# Statuses of a mapping row.
STATUSES = ("compared", "tied", "missing", "unexpected", "skipped", "ignored")


def render(lines: Iterable[object]) -> str:
    """Human output from raw lines: each line `shown`, then joined.

    NOTE: [one rendering boundary] Findings, notes, reports and the command line keep keys,
    paths and messages as they were read (``--json`` and the Python API need them exact) and
    build their text as a list of lines; this is the one place where it becomes text for a
    terminal. The only line breaks in the result are the ones between `lines`.
    """
    return "\n".join(shown(line) for line in lines)


@dataclass(slots=True)  # slots: one per tensor of both sides
class MappingRow:
    """How one tensor was matched.

    Attributes:
        a: Its canonical name on side A (the live model, or ``actual``), None if only on B.
        b: The checkpoint's own key on side B (``expected``), None if only on A.
        status: "compared", "tied" (checked against the key of the parameter it is tied to),
            "missing" (only on B... or required by A and absent), "unexpected", "skipped" (not
            comparable: the reason says why) or "ignored" (excluded by the user).
        reason: Why, for every status but "compared".
    """

    a: str | None
    b: str | None
    status: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown mapping status {self.status!r}")


@dataclass
class Finding:
    """One thing that is wrong.

    Attributes:
        key: The live key (model FQN, or ``optim.state.<fqn>.<name>`` /
            ``optim.param_groups.<i>.<name>`` for the optimizer).
        kind: One of "missing", "unexpected", "shape", "dtype", "requires_grad", "layout",
            "gap" (a region no saved chunk covers), "skipped" (a tensor that could not be
            compared: the message says why), "value", "replica" (copies that should agree do
            not) or "error".
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
        abs_source: Through a conversion: the source tensor and index that the element at
            `max_abs_index` is made of.
        rel_source: The same for `max_rel_index`.
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
    abs_source: tuple[str, tuple[int, ...]] | None = None
    rel_source: tuple[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")

    def describe(self) -> str:
        """The finding in the words of torch.testing.assert_close, with global indices.

        Text for a terminal: the key and message are `shown` (their own line breaks and control
        characters made visible); ``lines()`` gives them as they are.
        """
        return render(self.lines())

    def lines(self) -> list[str]:
        """The finding's lines, with its key and message as they are (not yet `shown`)."""
        head = f"[{self.kind}] {self.key}"
        if self.kind != "value":
            return [f"{head}: {self.message}"]
        pct = 100.0 * self.mismatched / self.numel if self.numel else 0.0
        lines = [head + (f": {self.message}" if self.message else "")]
        if self.numel:  # fingerprint findings know that something differs, not how much
            lines.append(f"  Mismatched elements: {self.mismatched} / {self.numel} ({pct:.1f}%)")
        if self.max_abs_index is not None:
            lines.append(
                f"  Greatest absolute difference: {self.max_abs_diff} at index "
                f"{self.max_abs_index}{_from(self.abs_source)}{_on(self.rank)} "
                f"(up to {self.atol} allowed)"
            )
        if self.max_rel_index is not None:
            lines.append(
                f"  Greatest relative difference: {self.max_rel_diff} at index "
                f"{self.max_rel_index}{_from(self.rel_source)}{_on(self.rel_rank)} "
                f"(up to {self.rtol} allowed)"
            )
        return lines

    @classmethod
    def value(
        cls,
        key: str,
        stats: Any,
        shape: Sequence[int],
        *,
        rtol: float,
        atol: float,
        with_ranks: bool = True,
        checked: str = "on the checked side",
        reference: str = "in the reference",
    ) -> Finding:
        """A value finding from combined statistics (``collectives.Combined`` or ``KeyStats``).

        Args:
            key: The key.
            stats: numel, mismatched, zeros, nan_a, nan_e, max_abs(_idx, _rank), max_rel(...).
            shape: The global shape (indices are unravelled in it).
            rtol: Relative tolerance used.
            atol: Absolute tolerance used.
            with_ranks: Whether the maxima carry the rank that holds them.
            checked: How the hints name side A ("on the checked side", "in actual").
            reference: How they name side B ("in the reference", "in expected").
        """
        from fsdpcheck.box import unravel

        hints = []
        if stats.zeros == stats.numel:
            hints.append(f"every element {checked} is zero (zeroed, or never loaded?)")
        if stats.nan_a != stats.nan_e:
            hints.append(f"NaNs: {stats.nan_a} {checked}, {stats.nan_e} {reference}")
        has_abs, has_rel = stats.max_abs_idx >= 0, stats.max_rel_idx >= 0
        if has_abs and stats.max_abs == 0.0:
            # Every mismatch is a NaN or an infinity against something else: there is no finite
            # difference to point at, and "0.0 at index (0, 0)" would point at a matching element.
            has_abs = has_rel = False
            hints.append("the mismatches are NaN or infinite on one side (no finite difference)")
        return cls(
            key,
            "value",
            "; ".join(hints),
            mismatched=stats.mismatched,
            numel=stats.numel,
            max_abs_diff=stats.max_abs if has_abs else None,
            max_abs_index=unravel(stats.max_abs_idx, tuple(shape)) if has_abs else None,
            rank=getattr(stats, "max_abs_rank", None) if has_abs and with_ranks else None,
            max_rel_diff=stats.max_rel if has_rel else None,
            max_rel_index=unravel(stats.max_rel_idx, tuple(shape)) if has_rel else None,
            rel_rank=getattr(stats, "max_rel_rank", None) if has_rel and with_ranks else None,
            rtol=rtol,
            atol=atol,
        )

    @classmethod
    def replica(cls, key: str, groups: Sequence[Sequence[int]] | None) -> Finding:
        """Copies of the same elements differ: `groups` are ranks by content, largest first.

        None: the ranks were not looked up (only the first keys that disagree are).
        """
        if not groups:
            return cls(
                key,
                "replica",
                "copies of the same elements differ across ranks (their ranks are listed for "
                "the first keys that disagree only; check_replicas of this key names them)",
            )
        majority, *others = [list(g) for g in groups]
        return cls(
            key,
            "replica",
            f"copies of the same elements differ across ranks: ranks {majority} hold one value, "
            + "; ".join(f"ranks {g}" for g in others)
            + " another",
            rank=others[0][0],
            ranks=sorted(r for g in groups for r in g),
        )


def uncovered(
    key: str, covered: int, held_by: Sequence[int] | None, numel: int, what: str
) -> Finding:
    """The ranks' parts of `key` do not tile it: elements held by no rank, or by two.

    Args:
        key: The key.
        covered: The elements the ranks' parts hold, summed.
        held_by: Elements each rank holds, when known.
        numel: The key's global element count.
        what: The noun for a rank's part ("shards", "parts").
    """
    held = list(held_by or [])
    some = [r for r, n in enumerate(held) if n > 0]
    none = [r for r, n in enumerate(held) if n <= 0]
    who = ""
    if held:
        # Bounded: a key held by 16,384 ranks is not a 100 kB message.
        who = f" (held by ranks {_few(some)}" + (
            f"; ranks {_few(none)} hold none of it)" if none else ")"
        )
    gap = abs(numel - covered)
    lost = "are held by no rank" if covered < numel else f"are counted twice (overlapping {what})"
    return Finding(
        key,
        "layout",
        f"the ranks' {what} cover {covered} of its {numel} elements: {gap} {lost}{who}; "
        "did every rank pass the same model and optimizer, with every shard?",
        ranks=some,
    )


def _few(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


def normalized(findings: Sequence[Finding]) -> list[Finding]:
    """One finding per (key, kind, message), with every rank it happened on; key, then KINDS."""
    merged: dict[tuple[str, str, str], Finding] = {}
    for f in findings:
        k = (f.key, f.kind, f.message)
        if k in merged and f.kind != "value":
            merged[k].ranks = sorted(set(merged[k].ranks) | set(f.ranks))
            continue
        if k in merged:  # two value findings for one key cannot happen; keep both if they do
            k = (*k[:2], f"{f.message}\0{len(merged)}")
        merged[k] = f
    return sorted(merged.values(), key=lambda f: (f.key, _ORDER.get(f.kind, 99)))


@dataclass
class Report:
    """The verdict of a verification, identical on every rank.

    Attributes:
        findings: Everything wrong, sorted by key then kind.
        reference: What the live state was checked against.
        world_size: Ranks that took part.
        keys_checked: Keys compared.
        keys_a: Tensors on side A (the live model and optimizer; ``actual`` for compare).
        keys_b: Tensors on side B (the checkpoint; ``expected`` for compare).
        side_a: What side A is, for the summary ("live", "actual", ...).
        side_b: What side B is ("checkpoint", "expected", "manifest", ...).
        mapping: How every tensor of both sides was matched (MappingRow), in key order.
        elements_checked: Elements compared, over all ranks.
        bytes_read: Reference bytes read, over all ranks.
        seconds: Wall time of the slowest rank.
        notes: Things worth knowing that are not failures (e.g. a fallback taken).
    """

    findings: list[Finding] = field(default_factory=list)
    reference: str = ""
    world_size: int = 1
    keys_checked: int = 0
    keys_a: int | None = None
    keys_b: int | None = None
    side_a: str = "live"
    side_b: str = "checkpoint"
    mapping: list[MappingRow] = field(default_factory=list)
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

    def __post_init__(self) -> None:
        self.findings = normalized(self.findings)

    def skipped(self) -> list[MappingRow]:
        """Rows of tensors that were not compared and are not findings' keys (with reasons)."""
        return [r for r in self.mapping if r.status in ("skipped", "ignored")]

    def counts(self) -> str:
        """The counts line: N keys on A, M on B, K compared, S skipped (reasons); or ""."""
        if self.keys_a is None and self.keys_b is None:
            return ""
        skipped = [r for r in self.mapping if r.status in ("skipped", "ignored")]
        reasons: dict[str, int] = {}
        for r in skipped:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        return (
            f"{self.keys_a} keys on {self.side_a}, {self.keys_b} on {self.side_b}, "
            f"{self.keys_checked} compared, {len(skipped)} skipped" + (f" ({why})" if why else "")
        )

    def merge(self, other: Report, key_prefix: str = "") -> None:
        """Adds another report's findings, counts, mapping and notes to this one."""
        for f in other.findings:
            f.key = key_prefix + f.key
        for r in other.mapping:
            r.a = key_prefix + r.a if r.a is not None else None
        self.findings = normalized(self.findings + other.findings)
        self.mapping += other.mapping
        self.notes += [key_prefix + n for n in other.notes]
        self.world_size = max(self.world_size, other.world_size)
        self.keys_checked += other.keys_checked
        if other.keys_a is not None:
            self.keys_a = (self.keys_a or 0) + other.keys_a
        if other.keys_b is not None:
            self.keys_b = (self.keys_b or 0) + other.keys_b
        self.elements_checked += other.elements_checked
        self.bytes_read += other.bytes_read
        self.seconds += other.seconds

    def mapping_table(self) -> str:
        """The mapping as text, one row per tensor."""
        return render(self.mapping_lines())

    def mapping_lines(self) -> list[str]:
        """The mapping's rows (names aligned as they will be shown)."""
        names = [shown(r.a or "-") for r in self.mapping]
        width = max((len(n) for n in names), default=1)
        return [
            f"  {n:{width}s}  {r.status:10s}  {r.b or '-'}"
            + (f"  ({r.reason})" if r.reason else "")
            for n, r in zip(names, self.mapping)
        ]

    def summary(self) -> str:
        """One line: verdict and what was checked."""
        return shown(self._summary())

    def _summary(self) -> str:
        verdict = "OK" if self.ok else f"FAILED with {len(self.findings)} finding(s)"
        counts = self.counts()
        what = counts if counts else f"{self.keys_checked} keys"
        if self.elements_checked:
            what += f", {self.elements_checked:,} elements"
        if self.world_size > 1:
            what += f" on {self.world_size} ranks"
        read = f"{self.bytes_read / 1e6:,.1f} MB read in " if self.bytes_read else ""
        return f"fsdpcheck: {verdict}: {what} against {self.reference}; {read}{self.seconds:.2f} s"

    def lines(self) -> list[str]:
        """The report's lines (summary, findings, notes), as they are (not yet `shown`)."""
        out = [self._summary()]
        for f in self.findings:
            out += f.lines()
        return out + [f"note: {n}" for n in self.notes]

    def __str__(self) -> str:
        return render(self.lines())

    def raise_if_failed(self) -> None:
        """Raises VerificationError with the report's text when there is any finding."""
        if not self.ok:
            raise VerificationError(str(self))


def _on(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def _from(source: tuple[str, tuple[int, ...]] | None) -> str:
    return "" if source is None else f" <- {source[0]} {tuple(source[1])}"


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    return x
