"""Per-key statistics: what one rank found for a key, and what all ranks found together.

``KeyStats`` is filled locally from kernel results (``add``) and fingerprints (``add_copy``);
``collectives.combine`` turns every rank's ``KeyStats`` rows into one ``Combined`` per key,
identical on every rank. Offline comparisons use ``KeyStats`` alone (one process).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpcheck.box import Box, ravel
from fsdpcheck.kernels import MASK64, TensorDiff

# Columns of the summed counts.
COUNTS = ("numel", "mismatched", "nan_a", "nan_e", "inf_a", "inf_e", "zeros", "errors", "holders")


@dataclass
class KeyStats:
    """This rank's statistics for one key (over all its pieces).

    The copy fields describe this rank's copy of the key's elements for the fingerprint and
    replica checks: ``fp`` is the sum of its pieces' Fingerprint v1 (mod 2**64), ``box`` the
    global linear offset of its first piece (which box it is, among the copies), ``owner``
    whether this rank's copy is the one counted (True/False for layouts that say, e.g. the
    rank at coordinate 0 of a DTensor's Replicate dims; None: the lowest rank holding the key),
    ``copy_numel`` the elements its pieces cover, ``replicated`` whether other ranks hold
    copies of the same elements, ``mesh_ranks`` the global ranks of a DTensor's mesh (when it is
    smaller than the job, the mesh holding the lowest rank holding the key counts).
    """

    numel: int = 0
    mismatched: int = 0
    nan_a: int = 0
    nan_e: int = 0
    inf_a: int = 0
    inf_e: int = 0
    zeros: int = 0
    errors: int = 0
    holders: int = 0  # 1 when this rank holds data of the key
    max_abs: float = -1.0
    max_abs_idx: int = -1
    max_rel: float = -1.0
    max_rel_idx: int = -1
    fp: int | None = None
    box: int = -1
    owner: bool | None = None
    copy_numel: int = 0
    replicated: bool = False
    mesh_ranks: frozenset[int] | None = None

    def add(self, d: TensorDiff, box: Box) -> None:
        """Adds one comparison result (maxima by global linear index, ties to the smallest)."""
        self.numel += d.numel
        self.mismatched += d.mismatched
        self.nan_a += d.nan_actual
        self.nan_e += d.nan_expected
        self.inf_a += d.inf_actual
        self.inf_e += d.inf_expected
        self.zeros += d.zeros or 0
        if d.max_abs_index is not None:
            lin, value = ravel(d.max_abs_index, box.shape), d.max_abs_diff
            if _beats(value, lin, self.max_abs, self.max_abs_idx):
                self.max_abs, self.max_abs_idx = value, lin
        if d.max_rel_index is not None:
            lin, value = ravel(d.max_rel_index, box.shape), d.max_rel_diff
            if _beats(value, lin, self.max_rel, self.max_rel_idx):
                self.max_rel, self.max_rel_idx = value, lin
        if d.fingerprint_actual is not None:
            self.add_copy(d.fingerprint_actual, box, d.numel)

    def cover(self, numel: int, box: Box) -> None:
        """Counts elements of this rank's copy that were compared without a fingerprint.

        For the coverage check (the counted copies must tile the key); ``add_copy`` counts
        them when there is a fingerprint.
        """
        self.copy_numel += numel
        if self.box < 0:
            assert box.offset is not None
            self.box = ravel(box.offset, box.shape)

    def add_copy(self, fingerprint: int, box: Box, numel: int) -> None:
        """Adds one piece of this rank's copy: its fingerprint and the elements it covers."""
        self.fp = ((self.fp or 0) + fingerprint) & MASK64
        self.copy_numel += numel
        if self.box < 0:
            assert box.offset is not None
            self.box = ravel(box.offset, box.shape)


def _beats(value: float, index: int, best: float, best_index: int) -> bool:
    """Whether (value, index) is a greater maximum than the best so far (ties: smaller index)."""
    return value > best or (value == best and (best_index < 0 or index < best_index))


@dataclass
class Combined:
    """One key's statistics over all ranks.

    Attributes:
        counts: The summed COUNTS (also readable as attributes: numel, mismatched, ...).
        max_abs: Greatest absolute difference over all ranks (-1 when none).
        max_abs_idx: Its global linear index (the smallest among ties), -1 when none.
        max_abs_rank: The lowest rank holding that element, -1 when none.
        max_rel: Greatest relative difference.
        max_rel_idx: Its global linear index.
        max_rel_rank: The lowest rank holding it.
        fingerprint: Fingerprint v1 of the key: the sum of the counted copies, or None when no
            rank fingerprinted it.
        covered: Elements the counted copies cover (the key's numel when they tile it).
        counted_mismatched: Mismatched elements of the counted copies (each element once).
        replicas_disagree: Copies of the same elements differ on some ranks.
        replica_groups: Ranks grouped by the content of their copy of the first box whose
            copies differ (when that was looked up), largest group first.
        held_by: Elements each rank's copy covers, in rank order, when the copies do not tile
            the key (looked up for the first keys only; else None).
    """

    counts: dict[str, int]
    max_abs: float
    max_abs_idx: int
    max_abs_rank: int
    max_rel: float
    max_rel_idx: int
    max_rel_rank: int
    fingerprint: int | None = None
    covered: int = 0
    counted_mismatched: int = 0
    replicas_disagree: bool = False
    replica_groups: list[list[int]] | None = None
    held_by: list[int] | None = None

    @property
    def numel(self) -> int:
        """Elements compared."""
        return self.counts["numel"]

    @property
    def mismatched(self) -> int:
        """Elements that differ."""
        return self.counts["mismatched"]

    @property
    def zeros(self) -> int:
        """Zero elements on the checked side."""
        return self.counts["zeros"]

    @property
    def nan_a(self) -> int:
        """NaNs on the checked side."""
        return self.counts["nan_a"]

    @property
    def nan_e(self) -> int:
        """NaNs in the reference."""
        return self.counts["nan_e"]

    @property
    def errors(self) -> int:
        """Ranks (or pieces) that could not compare the key."""
        return self.counts["errors"]

    @property
    def holders(self) -> int:
        """Ranks holding data of the key."""
        return self.counts["holders"]


__all__ = ["COUNTS", "Combined", "KeyStats"]
