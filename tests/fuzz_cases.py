"""Helpers for the security and fuzz tests: hostile payloads, small checkpoints, a watchdog."""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Planted:
    """Unpickling this calls ``open(canary, "w")``: the file appearing means code ran."""

    def __init__(self, canary: Path) -> None:
        self.canary = str(canary)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.canary, "w"))


def hostile_pickle(canary: Path) -> bytes:
    """A pickle that creates `canary` when loaded by an unrestricted unpickler."""
    return pickle.dumps(Planted(canary))


def compare_checkpoints(actual: Any, expected: Any) -> Any:
    """fsdpcheck's checkpoint-vs-checkpoint compare, wherever this version keeps it."""
    try:
        from fsdpcheck.comparison import compare_checkpoints as cmp
    except ImportError:
        from fsdpcheck.ckpt_compare import compare_checkpoints as cmp
    return cmp(actual, expected)


def tiny_state(seed: int = 0) -> dict[str, Any]:
    """A small model + optimizer state: 2-D weights, biases, a step, hyperparameters."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "0.weight": torch.randn(7, 5, generator=g),
            "0.bias": torch.randn(7, generator=g),
            "2.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "state": {
                name: {"exp_avg": torch.randn(shape, generator=g), "step": torch.tensor(3.0)}
                for name, shape in (("0.weight", (7, 5)), ("0.bias", (7,)), ("2.weight", (3, 7)))
            },
            "param_groups": [{"lr": 0.01, "params": ["0.weight", "0.bias", "2.weight"]}],
        },
    }


def save_dcp(path: Path, state: dict[str, Any] | None = None) -> Path:
    """A real ``dcp.save`` of `state` (default: `tiny_state`) without a process group."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state if state is not None else tiny_state(), checkpoint_id=str(path),
                 no_dist=True)  # fmt: skip
    return path


def edit_metadata(path: Path, edit: Callable[[Any], None]) -> None:
    """Rewrites ``path/.metadata`` after `edit` (a trusted test-side plain unpickle)."""
    f = path / ".metadata"
    md = pickle.loads(f.read_bytes())
    edit(md)
    f.write_bytes(pickle.dumps(md))


class Hang(AssertionError):
    """A call did not finish within the watchdog's limit."""


def bounded(
    fn: Callable[[], Any], seconds: float, unblock: Callable[[], None] | None = None
) -> Any:
    """Runs `fn` in a daemon thread; its result, its exception, or `Hang` after `seconds`.

    `unblock` (e.g. opening a FIFO's other end) lets a stuck thread finish after a Hang.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if unblock is not None:
            unblock()
        raise Hang(f"did not finish within {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def release_fifo(path: Path) -> Callable[[], None]:
    """Opens `path`'s write end without blocking, so a reader stuck on it returns."""

    def unblock() -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    return unblock
