"""The live side: a model's (and optimizer's) state as flat keys of DTensors/tensors."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import torch

from fsdpcheck import keys as keymod


def live_state_dicts(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict | None]:
    """The model state dict (tensor leaves) and the optimizer state dict, FQN-keyed."""
    if isinstance(model, torch.nn.Module):
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        msd = dict(get_model_state_dict(model))
        osd = None
        if optimizer is not None:
            osd = (
                dict(optimizer)
                if isinstance(optimizer, Mapping)
                else get_optimizer_state_dict(model, optimizer)
            )
        return tensor_leaves(msd), osd
    if isinstance(model, Mapping):
        if optimizer is not None and not isinstance(optimizer, Mapping):
            raise TypeError(
                "with a state dict as `model`, pass the optimizer as its state dict "
                "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, opt))"
            )
        return tensor_leaves(dict(model)), (dict(optimizer) if optimizer is not None else None)
    raise TypeError(f"model must be an nn.Module or a state dict, not {type(model).__name__}")


# Components that wrappers (FSDP1, activation checkpointing, DDP, torch.compile) add to names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def requires_grad_map(model: Any) -> dict[str, bool]:
    """requires_grad of each parameter by its state-dict FQN (wrapper components removed)."""
    if not isinstance(model, torch.nn.Module):
        return {k: v.requires_grad for k, v in model.items() if isinstance(v, torch.nn.Parameter)}
    out = {}
    for name, p in model.named_parameters():
        parts = [x for x in name.split(".") if x not in _WRAPPER_PARTS]
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and parts[0] == "module":
            parts = parts[1:]
        out[".".join(parts)] = p.requires_grad
    return out


def tensor_leaves(sd: dict[str, Any]) -> dict[str, Any]:
    """The tensor entries of a state dict."""
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def describe_error(exc: BaseException) -> str:
    """An exception in one line: type, message and where it was raised."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    loc = f" (at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{loc}"


def flat_live(
    model: torch.nn.Module | Mapping[str, Any], optimizer: Any = None
) -> dict[str, torch.Tensor]:
    """Every live tensor by its key: model FQNs and ``optim.state.<fqn>.<name>``."""
    msd, osd = live_state_dicts(model, optimizer)
    out: dict[str, torch.Tensor] = dict(msd)
    for fqn, states in (osd or {}).get("state", {}).items():
        for name, value in states.items():
            if isinstance(value, torch.Tensor):
                out[keymod.optim_key(str(fqn), name)] = value
    return out
