"""Checks inside a training run: what a resume loaded, and replicas that must stay identical.

``ReplicaWatch`` fingerprints every rank's local shards every N steps and compares the copies
that must agree bit for bit (the replicate dimension of HSDP, DDP replicas, tensor-parallel
replicated parameters, the optimizer ``step`` every rank keeps): a bad host, a corrupted
all-reduce or a rank that resumed from another step shows up as a "replica" finding naming the
key, the groups of ranks that hold each version, and the ranks. ``verify_resumed`` is the check
the trainer integrations run after a resume: ``load``'s fingerprint check against an fsdpcheck
manifest when the checkpoint has one, else ``verify`` against the checkpoint's files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import RankFailure, call
from fsdpcheck.fingerprints import check_replicas
from fsdpcheck.loading import check_against_manifest
from fsdpcheck.manifest import read_manifest
from fsdpcheck.report import Report
from fsdpcheck.verification import verify

__all__ = ["ReplicaWatch", "verify_resumed"]


class ReplicaWatch:
    """Every `every` steps, checks that the copies of each shard agree on every rank holding one.

    Collective: every rank of `group` calls ``step()`` once per training step, after the
    optimizer step, the same number of times (ranks that call it a different number of times
    would wait for each other). On the steps it checks, each rank fingerprints its local shards
    (model, and optimizer state when given) in one fused pass and the ranks all-reduce one row
    per key (O(keys) bytes per rank at any world size; NOTE: [bytes per rank] in
    ``collectives``); no tensor is gathered or copied, and nothing it reads is changed.

    Example::

        watch = fsdpcheck.ReplicaWatch(model, optimizer, every=100)
        for batch in data:
            loss = model(batch).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
            report = watch.step()
            if report is not None:
                report.raise_if_failed()

    Args:
        model: The model (HSDP, FSDP2, TP, 2D, DDP, plain, or wrapped by Lightning/accelerate).
        optimizer: Its optimizer (or a wrapper of several); its state (moments, ``step``) is
            compared too. An optimizer that has not stepped yet is skipped, with a note.
        every: Check on every `every`-th call of ``step()`` (1: every call).
        group: The process group (default: the default group).
        timeout: Seconds a rank waits in one collective for the others before it names the
            ranks that did not answer (default: the process group's timeout).

    Each check compares `every`, the step count and whether an optimizer is given across the
    ranks first (a watch made differently on one rank, or stepped a different number of times,
    ends the check on every rank with ``RanksDisagreeError`` naming it).

    Attributes:
        steps: Calls of ``step()`` so far.
        last: The Report of the latest check, or None before the first.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        every: int = 100,
        group: Any = None,
        timeout: float | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ReplicaWatch: every must be an int >= 1, got {every!r}")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.group = group
        self.timeout = timeout
        self.steps = 0
        self.last: Report | None = None

    def step(self) -> Report | None:
        """Counts a training step; on every `every`-th one, checks the replicas.

        Returns:
            The Report (identical on every rank; ``raise_if_failed()`` raises on a finding) on
            the steps it checks, None on the others.
        """
        self.steps += 1
        if self.steps % self.every:
            return None
        return self.check()

    def check(self) -> Report:
        """Checks the replicas now, whatever the step count (collective)."""
        with call("ReplicaWatch.step", self.group, self.timeout) as c:
            c.arguments(every=self.every, steps=self.steps, optimizer=given(self.optimizer))
            report = check_replicas(self.model, optimizer=self.optimizer, group=self.group)
        # Before the optimizer's first step there is no state to compare; that is not a replica
        # problem, so the watch says so in a note instead of failing the run.
        unstepped = [f for f in report.findings if f.kind == "missing" and f.key == "optim.state"]
        if unstepped:
            report.findings = [f for f in report.findings if f not in unstepped]
            report.notes.append("the optimizer has no state yet: its state was not compared")
        report.reference = f"the other replicas at step {self.steps}"
        self.last = report
        return report


def verify_resumed(
    model: Any,
    checkpoint: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    files: Sequence[str | os.PathLike[str]] | None = None,
    group: Any = None,
    timeout: float | None = None,
    **verify_kwargs: Any,
) -> Report:
    """Checks what a trainer loaded from `checkpoint` into the model (and optimizer).

    Collective. With an fsdpcheck manifest in the checkpoint directory, this is ``load``'s
    fingerprint check: one fused pass over every rank's shards and a few all-reduces of one row
    per key, no second read of the checkpoint. Without one, it is ``fsdpcheck.verify`` against
    the checkpoint's files (every element, each rank reading only the chunks overlapping its
    shards, the metadata checked once per job).

    Args:
        model: The model after the trainer's load.
        checkpoint: The checkpoint directory (or file) the trainer resumed from.
        optimizer: The optimizer after the load (its state is checked too), or None.
        files: The files or DCP directories to verify against when there is no manifest
            (default: `checkpoint` itself).
        group: The process group.
        timeout: Seconds a rank waits in one collective for the others before it names the
            ranks that did not answer (default: the process group's timeout).
        **verify_kwargs: Passed to ``fsdpcheck.verify`` (rtol, atol, ignore, memory_budget...).

    Returns:
        The Report, identical on every rank; its notes say which check ran.

    Raises:
        RanksDisagreeError: The ranks passed different arguments, or found a manifest on some
            ranks and not on others (a filesystem not yet in sync).
    """
    with call("verify_resumed", group, timeout) as c:
        path = Path(checkpoint)
        agreed = {k: v for k, v in verify_kwargs.items() if k not in ("memory_budget", "group")}
        c.arguments(optimizer=given(optimizer), files=given(files), **agreed)
        try:
            manifest = c.step(
                f"reading the fsdpcheck manifest of {path}",
                lambda: read_manifest(path) if path.is_dir() else None,
                agree_on=lambda m: None if m is None else (m.created, len(m.entries)),
            )
        except RankFailure as f:
            raise f.failure.error() from None
        if manifest is not None:
            report = check_against_manifest(model, manifest, path, optimizer=optimizer, group=group)
            report.notes.append(f"checked by fingerprint against the fsdpcheck manifest of {path}")
            return report
        reference: Any = [Path(f) for f in files] if files else path
        report = verify(model, reference, optimizer=optimizer, group=group, **verify_kwargs)
        report.notes.insert(0, f"no fsdpcheck manifest in {path}: verified against its files")
        return report
