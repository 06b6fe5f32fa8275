"""Hugging Face ``transformers.Trainer``: verify what ``resume_from_checkpoint`` restored.

Example::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[VerifyOnResume(watch_every=100)])
    trainer.train(resume_from_checkpoint=True)

At each save the callback writes fsdpcheck's manifest into ``checkpoint-N/`` (one fingerprint
pass over every rank's shards); at ``on_train_begin`` of a resumed run, after the Trainer
restored the weights and the optimizer, every rank checks its shards against that manifest,
or, for a checkpoint without one, ``fsdpcheck.verify`` against its files (``model.safetensors``
or the sharded index, ``pytorch_model_fsdp_0/`` under FSDP, and ``optimizer.pt`` /
``optimizer_0/``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import RankFailure, call
from fsdpcheck.formats.transformers import OPTIMIZER_FILES, trainer_files
from fsdpcheck.integrations._resume import (
    ON_FAILURE,
    ResumeCheck,
    verify_resumed,
    write_checkpoint_manifest,
)
from fsdpcheck.manifest import Manifest
from fsdpcheck.report import Report

__all__ = ["ON_FAILURE", "VerifyOnResume", "checkpoint_files"]

log = logging.get_logger(__name__)


def checkpoint_files(folder: str | os.PathLike[str], optimizer: bool = True) -> list[Path]:
    """The model (and optimizer) files of a Trainer ``checkpoint-N`` folder, model first.

    Raises:
        FileNotFoundError: The folder holds no model checkpoint the Trainer writes.
    """
    return trainer_files(Path(folder), optimizer)


class VerifyOnResume(ResumeCheck, TrainerCallback):
    """Verifies the model and optimizer after ``trainer.train(resume_from_checkpoint=...)``.

    Args:
        checkpoint: The folder resumed from. Default: ``args.resume_from_checkpoint``, else
            ``<output_dir>/checkpoint-<global_step>`` of the restored state (what
            ``resume_from_checkpoint=True`` picks).
        on_failure: "raise" (``VerificationError`` on every rank before any step on wrong
            weights), "stop" (log the report, ``control.should_training_stop``) or "warn".
        check_optimizer: Check the optimizer state too.
        write_manifest: At each save, write fsdpcheck's manifest into the checkpoint folder, so
            a resume is checked by fingerprint (also against changes on disk).
        watch_every: Run a ``ReplicaWatch`` every this many optimizer steps (None: no watch).
        **verify_kwargs: Passed to ``fsdpcheck.verify`` (rtol, atol, ignore, memory_budget...).

    Attributes:
        report: The resume check's Report (None when the run did not resume).
        watch_report: The latest ReplicaWatch Report.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        *,
        on_failure: str = "raise",
        check_optimizer: bool = True,
        write_manifest: bool = True,
        watch_every: int | None = None,
        **verify_kwargs: Any,
    ) -> None:
        super().__init__(
            on_failure=on_failure, watch_every=watch_every, verify_kwargs=verify_kwargs
        )
        self.checkpoint = checkpoint
        self.check_optimizer = check_optimizer
        self.write_manifest = write_manifest

    def on_train_begin(  # noqa: D102
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **_: Any,
    ) -> None:
        optimizer = optimizer if self.check_optimizer else None
        self.start_watch(model, optimizer)

        def locate() -> tuple[Path | None, list[Path]]:
            folder = self._resumed_from(args, state)
            if folder is None:
                return None, []
            files = checkpoint_files(folder, optimizer is not None)
            if optimizer is not None and len(files) == 1:
                raise FileNotFoundError(
                    f"{folder} holds no optimizer state ({', '.join(OPTIMIZER_FILES)}); pass "
                    "VerifyOnResume(check_optimizer=False) to check the model only"
                )
            return folder, files

        # A folder one rank cannot see must fail on every rank, not leave the others waiting.
        with call("VerifyOnResume", None, self.verify_kwargs.get("timeout")) as c:
            c.arguments(checkpoint=given(self.checkpoint), optimizer=given(optimizer))
            try:
                folder, files = c.step(
                    "finding the checkpoint the run resumed from",
                    locate,
                    agree_on=lambda f: (None if f[0] is None else f[0].name, len(f[1])),
                )
            except RankFailure as f:
                raise f.failure.error() from None
            if folder is None:
                return
            self.report = verify_resumed(
                model, folder, optimizer=optimizer, files=files, **self.verify_kwargs
            )
        self._handle(state, control, self.report, f"resume from {folder}")

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:  # noqa: D102
        report = self.watch_step()
        if report is not None:
            self._handle(state, control, report, f"replica watch at step {state.global_step}")

    def on_save(  # noqa: D102
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **_: Any,
    ) -> None:
        if not self.write_manifest:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        optimizer = optimizer if self.check_optimizer else None
        write_folder_manifest(model, folder, optimizer=optimizer)

    def _resumed_from(self, args: Any, state: Any) -> Path | None:
        if self.checkpoint is not None:
            return Path(self.checkpoint)
        given = getattr(args, "resume_from_checkpoint", None)
        if isinstance(given, (str, os.PathLike)) and given:
            return Path(given)
        if state.global_step > 0:
            guess = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not guess.is_dir():
                raise FileNotFoundError(
                    f"the run resumed at step {state.global_step} but {guess} does not exist; "
                    "pass VerifyOnResume(checkpoint=<the folder resumed from>)"
                )
            return guess
        return None

    def _handle(self, state: Any, control: Any, report: Report, what: str) -> None:
        def stop() -> None:
            control.should_training_stop = True

        self.handle(report, what, log=log, leader=state.is_world_process_zero, stop=stop)


def write_folder_manifest(
    model: Any, folder: str | os.PathLike[str], *, optimizer: Any = None, group: Any = None
) -> Manifest:
    """Writes fsdpcheck's manifest of the live model (and optimizer) into a checkpoint folder.

    Collective. Call it right after the folder was written and before the next optimizer step,
    so that the live state is what was saved.
    """
    root = Path(folder)
    return write_checkpoint_manifest(
        model,
        root,
        optimizer=optimizer,
        files=lambda: checkpoint_files(root, optimizer is not None),
        group=group,
    )
