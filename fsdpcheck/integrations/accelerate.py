"""Hugging Face accelerate: verify what ``Accelerator.load_state`` loaded.

Example:
    accelerator.load_state(input_dir)
    report = verify_state(accelerator, input_dir)
    report.raise_if_failed()
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdpcheck.dist.runner import RankFailure, call
from fsdpcheck.formats import accelerate_parts
from fsdpcheck.report import Finding, Report
from fsdpcheck.verification import verify


def verify_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str],
    **verify_kwargs: Any,
) -> Report:
    """Verifies the accelerator's prepared models and optimizers against a save_state directory.

    Collective (every process calls it, like ``load_state``). Model i is checked against
    ``pytorch_model_fsdp_i/`` (sharded, DCP) or the full-state file accelerate wrote for it, and
    optimizer i (paired with model i) against ``optimizer_i/`` or ``optimizer.bin``.

    Args:
        accelerator: The ``accelerate.Accelerator`` after ``prepare`` (and ``load_state``).
        input_dir: The directory given to ``save_state`` / ``load_state``.
        **verify_kwargs: Passed to ``fsdpcheck.verify`` (rtol, atol, memory_budget, ...).

    Returns:
        One Report for all models and optimizers (keys prefixed ``model<i>/`` when there are
        several models).
    """
    with call("accelerate verify_state", None, verify_kwargs.get("timeout")) as c:
        try:
            parts = c.step(
                "finding the saved models and optimizers",
                lambda: _parts(accelerator, Path(input_dir)),
                agree_on=lambda p: [(m is not None, o is not None) for m, o in p],
            )
        except RankFailure as f:
            raise f.failure.error() from None
        return _verify_state(accelerator, input_dir, parts, verify_kwargs)


def _parts(accelerator: Any, root: Path) -> list[tuple[Path | None, Path | None]]:
    models = list(getattr(accelerator, "_models", []))
    if not models:
        raise ValueError("the accelerator has no prepared model: call accelerator.prepare first")
    return [accelerate_parts(root, i) for i in range(len(models))]


def _verify_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str],
    parts: list[tuple[Path | None, Path | None]],
    verify_kwargs: dict[str, Any],
) -> Report:
    models = list(getattr(accelerator, "_models", []))
    optimizers = list(getattr(accelerator, "_optimizers", []))
    combined = Report(reference=f"accelerate save_state directory {input_dir}")
    for i, model in enumerate(models):
        model_path, optim_path = parts[i]
        optimizer = (
            optimizers[i] if i < len(optimizers) and len(optimizers) == len(models) else None
        )
        if optimizer is None and len(models) == 1 and optimizers:
            optimizer = optimizers[0]
        prefix = f"model{i}/" if len(models) > 1 else ""
        if model_path is None:
            combined.findings.append(
                Finding(prefix + "*", "missing", f"no model checkpoint {i} in {input_dir}")
            )
            continue
        # Paths, not opened sources: verify opens them itself, so that a file one rank cannot
        # read becomes a finding on every rank instead of an exception that leaves the others
        # waiting in verify's collectives.
        reference: list[Path] = [model_path]
        if optimizer is not None and optim_path is not None:
            reference.append(optim_path)
        elif optimizer is not None:
            combined.notes.append(f"{prefix}no optimizer state saved in {input_dir}")
            optimizer = None
        # Wrappers (DDP, AcceleratedOptimizer) are seen through by verify's key model.
        combined.merge(verify(model, reference, optimizer=optimizer, **verify_kwargs), prefix)
    return combined
