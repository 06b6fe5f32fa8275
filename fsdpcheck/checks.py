"""The checks before values are compared, in one place for every entry point.

A pair (side A's tensor and side B's entry, ``matching``) is compared element-wise only when
its global shapes are equal, both dtypes can be compared and side B holds real values (not a
placeholder); a storage problem of either side (a gap, a bad entry) is a finding of its own and
the tensors it touches are never read. ``verify`` (live against a checkpoint), ``compare`` (a
checkpoint against another) and ``fingerprint`` ask the same questions here, and the answers are
worded through the sides' names (``matching.Words``), never by rewriting finding text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from fsdpcheck.kernels import SUPPORTED_DTYPES
from fsdpcheck.report import Finding, MappingRow

if TYPE_CHECKING:
    from fsdpcheck.convert import Conversion
    from fsdpcheck.matching import Words

Problem = tuple[str, str, str]


def problem_findings(
    problems: Iterable[Problem], name_of: Callable[[str], str], prefix: str = ""
) -> tuple[list[Finding], set[str]]:
    """A source's storage problems as findings, and the keys they make unreadable.

    Args:
        problems: ``Source.problems()``: (its own key, kind "gap" or "error", message).
        name_of: The name findings use for a key of that source.
        prefix: Put before each message (which side, when both sides are files).
    """
    findings = []
    bad = set()
    for key, kind, message in problems:
        findings.append(
            Finding(name_of(key), "gap" if kind == "gap" else "error", prefix + message)
        )
        bad.add(key)
    return findings, bad


def pair_checks(
    name: str,
    a: tuple[tuple[int, ...], torch.dtype | None],
    b: tuple[tuple[int, ...], torch.dtype | None],
    words: Words,
    *,
    check_dtype: bool,
    placeholder: str | None = None,
) -> tuple[list[Finding], str | None]:
    """Whether a pair's values can be compared, and the findings about it.

    Args:
        name: The pair's name in findings.
        a: Side A's global shape and dtype.
        b: Side B's.
        words: How the entry point names its sides.
        check_dtype: Whether a dtype difference is a finding.
        placeholder: Why side B's entry stands for values stored elsewhere, if it does.

    Returns:
        The findings, and None when the values are to be compared, else why not (a mapping
        row's reason).
    """
    (sa, da), (sb, db) = a, b
    if placeholder is not None:
        return [Finding(name, "skipped", placeholder)], "a placeholder"
    if tuple(sa) != tuple(sb):
        message = f"global shape {tuple(sa)} {words.at_a} but {tuple(sb)} {words.at_b}"
        return [Finding(name, "shape", message)], "shape"
    if da not in SUPPORTED_DTYPES or db not in SUPPORTED_DTYPES:
        message = f"dtype {da} {words.at_a}, {db} {words.at_b}: cannot be compared element-wise"
        return [Finding(name, "skipped", message)], "unsupported dtype"
    if da != db and check_dtype:
        return [Finding(name, "dtype", f"{da} {words.at_a} but {db} {words.at_b}")], None
    return [], None


def coverage(conv: Conversion, words_a: str = "live") -> tuple[list[Finding], list[MappingRow]]:
    """Findings for targets the pieces do not tile and source elements no target reads.

    Returns:
        Gap findings (target names), unexpected findings (source names), and a mapping row per
        source the conversion leaves out on purpose, with its reason.
    """
    findings = [Finding(name, "gap", why) for name, why in conv.target_problems().items()]
    for name, (n, where) in conv.source_unused().items():
        numel = math.prod(conv.sources[name][0])
        findings.append(
            Finding(
                name,
                "unexpected",
                f"{n} of its {numel} elements {words_a} are in no tensor the conversion writes"
                + (f" (e.g. {where})" if where else ""),
            )
        )
    rows = [
        MappingRow(name, None, "ignored", f"left out by the conversion: {why}")
        for name, why in sorted(conv.dropped.items())
    ]
    return findings, rows


__all__ = ["coverage", "pair_checks", "problem_findings"]
