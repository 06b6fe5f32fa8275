"""Lightning: verify what ``trainer.fit(ckpt_path=...)`` / ``fabric.load`` restored; watch replicas.

Trainer::

    trainer = L.Trainer(..., callbacks=[VerifyOnResume(watch_every=100)])
    trainer.fit(model, ckpt_path="last")

Fabric::

    fabric.load(path, state)
    verify_after_load(fabric, path, state).raise_if_failed()

Works with ``ModelParallelStrategy`` (FSDP2, TP: a DCP directory) and with the strategies that
write one ``.ckpt`` file (single device, DDP). Lightning checkpoints carry no fsdpcheck manifest,
so the check is ``fsdpcheck.verify`` against the checkpoint (each rank reads only the chunks
overlapping its shards); a directory that has one is checked by fingerprint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import RankFailure, call
from fsdpcheck.integrations._resume import ON_FAILURE, ResumeCheck, verify_resumed
from fsdpcheck.report import Report

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the standalone pytorch_lightning package
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]

__all__ = ["ON_FAILURE", "VerifyOnResume", "verify_after_load"]

log = logging.getLogger(__name__)


class _Optimizers:
    """Several optimizers seen as one (``inner_optimizers`` looks through ``.optimizers``)."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers


def _one_optimizer(optimizers: list[Any]) -> Any:
    if not optimizers:
        return None
    return optimizers[0] if len(optimizers) == 1 else _Optimizers(list(optimizers))


class VerifyOnResume(ResumeCheck, Callback):
    """Verifies the model and optimizers after ``trainer.fit(ckpt_path=...)`` restored them.

    At ``on_train_start`` (after Lightning restored the weights and the optimizer state),
    every rank checks its shards against ``trainer.ckpt_path``; a run that did not resume is
    not checked. Optionally a ``ReplicaWatch`` runs every `watch_every` training batches.

    Args:
        on_failure: "raise" (``VerificationError`` on every rank: the run stops before a
            single step on wrong weights), "stop" (log the report and set
            ``trainer.should_stop``) or "warn" (log it and go on).
        check_optimizer: Check the optimizers' state too.
        watch_every: Run a ``ReplicaWatch`` every this many training batches (None: no watch).
        **verify_kwargs: Passed to ``fsdpcheck.verify`` (rtol, atol, ignore, memory_budget...).

    Attributes:
        report: The resume check's Report (None before it ran).
        watch_report: The latest ReplicaWatch Report.
    """

    def __init__(
        self,
        *,
        on_failure: str = "raise",
        check_optimizer: bool = True,
        watch_every: int | None = None,
        **verify_kwargs: Any,
    ) -> None:
        super().__init__(
            on_failure=on_failure, watch_every=watch_every, verify_kwargs=verify_kwargs
        )
        self.check_optimizer = check_optimizer

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # noqa: D102
        optimizer = _one_optimizer(list(trainer.optimizers)) if self.check_optimizer else None
        self.start_watch(pl_module, optimizer)
        path = trainer.ckpt_path
        with call("VerifyOnResume", None, self.verify_kwargs.get("timeout")) as c:
            # Every rank resumed, or none did: agreed before any other collective.
            c.arguments(resumed=given(path), optimizer=given(optimizer))
            try:
                c.check("agreeing on the resume")
            except RankFailure as f:
                raise f.failure.error() from None
            if path is None:
                return
            self.report = verify_resumed(pl_module, path, optimizer=optimizer, **self.verify_kwargs)
        self._handle(trainer, self.report, f"resume from {path}")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:  # noqa: D102
        report = self.watch_step()
        if report is not None and self._watch is not None:
            self._handle(trainer, report, f"replica watch at batch {self._watch.steps}")

    def _handle(self, trainer: Any, report: Report, what: str) -> None:
        def stop() -> None:
            trainer.should_stop = True

        self.handle(report, what, log=log, leader=trainer.is_global_zero, stop=stop)


def verify_after_load(
    fabric: Any,
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    **verify_kwargs: Any,
) -> Report:
    """Verifies what ``fabric.load(path, state)`` restored into the module and optimizer of `state`.

    Collective: every rank calls it after ``fabric.load``. `state` is the dict given to
    ``fabric.load``; its one module (Fabric-wrapped or not) and its optimizer(s) are checked
    against `path`, under the names the checkpoint gives them (``"model"``, ``"optimizer"``...).

    Args:
        fabric: The ``lightning.Fabric`` (its strategy's process group is used).
        path: The checkpoint given to ``fabric.load``.
        state: The state dict given to ``fabric.load``.
        **verify_kwargs: Passed to ``fsdpcheck.verify``.

    Returns:
        The Report, identical on every rank.

    Raises:
        ValueError: `state` holds no module, or several (verify each against its own keys with
            ``fsdpcheck.verify(module, path, key_map=...)``).
    """
    del fabric  # Fabric runs on the default process group
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    if len(modules) != 1:
        raise ValueError(
            "verify_after_load needs exactly one module in the state given to fabric.load, "
            f"found {len(modules)} ({', '.join(modules) or 'none'})"
        )
    optimizers = [v for v in state.values() if _is_optimizer(v)]
    (module,) = modules.values()
    # The Fabric wrapper is seen through by the key model (fsdpcheck.live).
    return verify_resumed(module, path, optimizer=_one_optimizer(optimizers), **verify_kwargs)


def _is_optimizer(v: Any) -> bool:
    return isinstance(v, torch.optim.Optimizer) or isinstance(
        getattr(v, "optimizer", None), torch.optim.Optimizer
    )
