"""What the trainer integrations share: the failure policy, the replica watch, the resume check.

A trainer callback (``integrations.transformers``, ``integrations.lightning``) is a
``ResumeCheck`` and its trainer's callback class: the glue it keeps is where the trainer says a
run resumed, from which folder (the layout's module names its files: ``formats/<layout>.py``),
and how the trainer is told to stop. The check itself is ``verify_resumed`` (by fingerprint
against the manifest written at each save with ``write_checkpoint_manifest``, else against the
checkpoint's files), both re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fsdpcheck.report import Report
from fsdpcheck.saving import write_checkpoint_manifest
from fsdpcheck.watch import ReplicaWatch, verify_resumed

__all__ = ["ON_FAILURE", "ResumeCheck", "verify_resumed", "write_checkpoint_manifest"]

#: What a callback does when a check fails: "raise" (``VerificationError`` on every rank, before
#: a single step on wrong weights), "stop" (log the report and ask the trainer to stop) or
#: "warn" (log it and go on).
ON_FAILURE = ("raise", "stop", "warn")


class Log(Protocol):
    """The logger an integration writes to (its trainer's, or the standard library's)."""

    def info(self, msg: str, *args: object) -> None:
        """Logs at INFO."""

    def error(self, msg: str, *args: object) -> None:
        """Logs at ERROR."""


class ResumeCheck:
    """The failure policy and the replica watch of a trainer callback.

    Args:
        on_failure: One of ``ON_FAILURE``.
        watch_every: Run a ``ReplicaWatch`` every this many steps (None: no watch).
        verify_kwargs: Passed to ``fsdpcheck.verify`` by the resume check.

    Attributes:
        report: The resume check's Report (None when the run did not resume).
        watch_report: The latest ReplicaWatch Report.

    Raises:
        ValueError: `on_failure` is not one of ``ON_FAILURE``.
    """

    def __init__(
        self, *, on_failure: str, watch_every: int | None, verify_kwargs: dict[str, Any]
    ) -> None:
        super().__init__()  # the trainer's callback class, next in the method order
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, not {on_failure!r}")
        self.on_failure = on_failure
        self.watch_every = watch_every
        self.verify_kwargs = verify_kwargs
        self.report: Report | None = None
        self.watch_report: Report | None = None
        self._watch: ReplicaWatch | None = None

    def start_watch(self, model: Any, optimizer: Any) -> None:
        """Starts the replica watch over `model` (and `optimizer`) when one was asked for."""
        if self.watch_every is not None:
            self._watch = ReplicaWatch(model, optimizer, every=self.watch_every)

    def watch_step(self) -> Report | None:
        """Counts one step of the watch: its Report on the steps it checks, else None."""
        if self._watch is None:
            return None
        report = self._watch.step()
        if report is not None:
            self.watch_report = report
        return report

    def handle(
        self,
        report: Report,
        what: str,
        *,
        log: Log,
        leader: bool,
        stop: Callable[[], None],
    ) -> None:
        """Applies the failure policy to a report (the same on every rank).

        Args:
            report: The Report of a check.
            what: What was checked, for the log line.
            log: The integration's logger.
            leader: Whether this rank logs (one line for the job, not one per rank).
            stop: Asks the trainer to stop (for "stop").
        """
        if report.ok:
            if leader:
                log.info("fsdpcheck: %s: %s", what, report.summary())
            return
        if self.on_failure == "raise":
            report.raise_if_failed()
        if leader:
            log.error("fsdpcheck: %s failed:\n%s", what, report)
        if self.on_failure == "stop":
            stop()
