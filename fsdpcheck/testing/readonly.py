"""Proving that a call changed nothing: fingerprints of all state before and after.

A checker must never modify what it checks. ``unchanged`` records the fingerprint of every
parameter, buffer, gradient and optimizer state tensor on this rank (and the optimizer state's
key set) when the block starts, and raises if any differ when it ends::

    with unchanged(model, optimizer):
        fsdpcheck.verify(model, ckpt_dir, optimizer=optimizer)

It is local (no collectives), so a rank that finds a change raises without leaving the others
waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fsdpcheck._compat import is_dtensor, is_sharded_tensor
from fsdpcheck.kernels import fingerprint_tensor


def _local_pieces(t: torch.Tensor) -> list[torch.Tensor]:
    if is_dtensor(t):
        return [t.to_local()]  # type: ignore[attr-defined]
    if is_sharded_tensor(t):
        return [s.tensor for s in t.local_shards()]  # type: ignore[attr-defined]
    return [t]


def _digest(t: torch.Tensor) -> tuple[Any, ...]:
    """Dtype, shape and the fingerprint of the raw bytes of each local piece."""
    out: list[Any] = [str(t.dtype), tuple(t.shape)]
    for piece in _local_pieces(t):
        # Fingerprint the raw bytes, so every dtype (complex too) and every bit (-0.0, NaN
        # payloads) counts.
        raw = piece.detach().contiguous().reshape(-1).view(torch.uint8)
        out.append((tuple(piece.shape), piece.device.type, fingerprint_tensor(raw)))
    return tuple(out)


def _value(v: Any) -> Any:
    return _digest(v) if isinstance(v, torch.Tensor) else repr(v)


def snapshot(*objects: Any) -> dict[str, Any]:
    """What ``unchanged`` compares: one entry per tensor (and per optimizer key set) held here.

    Args:
        objects: Modules (parameters, buffers and gradients), optimizers (state tensors, the
            state's keys, param_group hyperparameters) and mappings of tensors (state dicts).
            Optimizer state is named by the FQNs of a module passed in the same call, else by
            position. ``None`` entries are ignored.

    Returns:
        Name -> a comparable digest (dtype, shape, local shapes and fingerprints of the bytes).
    """
    names: dict[int, str] = {}
    for obj in objects:
        if isinstance(obj, nn.Module):
            names.update({id(p): fqn for fqn, p in obj.named_parameters()})
    out: dict[str, Any] = {}
    for i, obj in enumerate(objects):
        if obj is None:
            continue
        tag = f"[{i}]"
        if isinstance(obj, nn.Module):
            for fqn, p in obj.named_parameters():
                out[f"{tag}param {fqn}"] = _digest(p)
                out[f"{tag}grad {fqn}"] = None if p.grad is None else _digest(p.grad)
            for fqn, b in obj.named_buffers():
                out[f"{tag}buffer {fqn}"] = _digest(b)
        elif isinstance(obj, torch.optim.Optimizer):
            # Read opt.state directly: torch's get_optimizer_state_dict would initialise empty
            # state by taking a step, the very change this looks for.
            for g, group in enumerate(obj.param_groups):
                hps = {k: v for k, v in group.items() if k != "params"}
                out[f"{tag}param_groups.{g}"] = repr(sorted(hps.items()))
                for j, p in enumerate(group["params"]):
                    name = names.get(id(p), f"{g}.{j}")
                    state = obj.state.get(p, {})
                    out[f"{tag}optim.state.{name} keys"] = sorted(state)
                    for k, v in state.items():
                        out[f"{tag}optim.state.{name}.{k}"] = _value(v)
            out[f"{tag}optim.state entries"] = len(obj.state)
        elif isinstance(obj, Mapping):
            out[f"{tag}keys"] = sorted(map(str, obj))
            for k, v in obj.items():
                out[f"{tag}{k}"] = _value(v)
        else:
            raise TypeError(
                "unchanged/snapshot take modules, optimizers and mappings, "
                f"not {type(obj).__name__}"
            )
    return out


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Names whose digest differs between two snapshots (or that only one has), sorted."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@contextlib.contextmanager
def unchanged(*objects: Any) -> Iterator[None]:
    """Raises AssertionError if the block changed any state of `objects` on this rank.

    Args:
        objects: As for ``snapshot``: modules, optimizers, mappings of tensors, or None.

    Raises:
        AssertionError: Names the changed entries (e.g. ``[0]param blocks.0.w1.weight``, the
            index being the argument's position) and this rank.
    """
    before = snapshot(*objects)
    yield
    changed = changes(before, snapshot(*objects))
    if changed:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        more = f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""
        raise AssertionError(
            f"state changed on rank {rank} by a call that must not change it: "
            f"{', '.join(changed[:8])}{more}"
        )
