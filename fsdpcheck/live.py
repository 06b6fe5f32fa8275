"""The live side, read-only: a model's and optimizer's state under canonical names.

Nothing here changes what it reads. In particular the optimizer state is read from the
optimizers themselves, never through ``torch.distributed.checkpoint.state_dict.
get_optimizer_state_dict``, which initialises an optimizer that has no state by running a step
(and so changes every parameter under weight decay).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck import _compat, names
from fsdpcheck.layout import FlatShard, Meta, global_meta, is_zero3, zero3_problem

__all__ = [
    "LiveState",
    "flat_live",
    "inner_optimizers",
    "live_state",
    "model_canonicalizer",
    "model_parts",
]


@dataclass
class LiveState:
    """What a rank holds, by canonical name.

    Attributes:
        model: Canonical FQN -> tensor (DTensor, ShardedTensor or plain), every state-dict
            tensor including tied duplicates and buffers.
        tied: Tied duplicate FQN -> the first FQN of the same parameter (named_parameters
            order): ``lm_head.weight -> model.embed_tokens.weight`` in a tied HF model.
        requires_grad: Canonical FQN -> requires_grad of each parameter.
        optim_state: FQN -> state name -> value, or None without an optimizer.
        param_groups: Each group's hyperparameters, ``params`` as a list of FQNs.
        problems: (key, kind, message) found while reading (an optimizer without state).
        buffers: Canonical FQN -> non-persistent buffer (not in the state dict: compared when a
            checkpoint holds it, not required when it does not).
        adapters: Names of the PEFT adapters of the model (``peft_config``), if any.
    """

    model: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    optim_state: dict[str, dict[str, Any]] | None = None
    param_groups: list[dict[str, Any]] | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)
    buffers: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()

    def tensors(self, *, dedupe_tied: bool = False) -> dict[str, Any]:
        """Every live tensor by canonical name: model FQNs and ``optim.state.<fqn>.<name>``."""
        out = {k: v for k, v in self.model.items() if not (dedupe_tied and k in self.tied)}
        for (fqn, name), value in self.state_tensors().items():
            out[names.optim_key(fqn, name)] = value
        return out

    def state_tensors(self) -> dict[tuple[str, str], Any]:
        """(parameter FQN, state name) -> tensor, for the optimizer state that is tensors."""
        return {
            (fqn, name): value
            for fqn, states in (self.optim_state or {}).items()
            for name, value in states.items()
            if isinstance(value, _TENSORS)
        }

    def names_only(self) -> LiveState:
        """The same names with each tensor replaced by its Meta (what ranks agree on)."""
        groups = None
        if self.param_groups is not None:
            groups = [{"params": list(g["params"])} for g in self.param_groups]
        return LiveState(
            model={k: _meta(v) for k, v in self.model.items()},
            tied=dict(self.tied),
            requires_grad={},
            optim_state=None
            if self.optim_state is None
            else {
                fqn: {n: _meta(v) for n, v in st.items() if isinstance(v, _TENSORS)}
                for fqn, st in self.optim_state.items()
            },
            param_groups=groups,
            buffers={k: _meta(v) for k, v in self.buffers.items()},
            adapters=self.adapters,
        )


_TENSORS = (torch.Tensor, Meta, FlatShard)


def _meta(v: Any) -> Meta:
    return v if isinstance(v, Meta) else global_meta(v)


def live_state(
    model: Any,
    optimizer: Any = None,
    *,
    model_state: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
) -> LiveState:
    """Reads a model (nn.Module or state dict) and optimizer under canonical names.

    Args:
        model: An nn.Module (FSDP2, TP, 2D, HSDP, DDP, FSDP1, plain, wrapped by Lightning,
            accelerate or torch.compile), a list of model parts (the pipeline stages a rank
            runs, named as in the whole model), or a state dict of DTensors / ShardedTensors /
            tensors.
        optimizer: A torch optimizer or a wrapper of one or several (torchtitan
            OptimizersContainer, Lightning/Fabric optimizers, accelerate AcceleratedOptimizer),
            or an FQN-keyed optimizer state dict (``{"state": ..., "param_groups": ...}``).
        model_state: The module's state dict when the caller already has it (``load`` loads
            into that one), or one per model part; default ``get_model_state_dict``.

    Returns:
        The LiveState. Reading changes nothing.
    """
    out = LiveState()
    parts = model_parts(model)
    if parts is not None:
        states: list[Any] = [model_state] * len(parts)
        if isinstance(model_state, (list, tuple)):
            if len(model_state) != len(parts):
                raise TypeError("model_state: one state dict per model part")
            states = list(model_state)
        first: dict[int, str] = {}
        canons = []
        for part, state in zip(parts, states):
            canons.append(_module_state(out, part, first, optimizer, state))
        if optimizer is not None:
            if isinstance(optimizer, Mapping):
                _state_dict_optimizer(out, optimizer, canons[0] if len(canons) == 1 else _same)
            else:
                _read_optimizers(out, parts, optimizer, first, canons)
        return out
    if isinstance(model, Mapping):
        if optimizer is not None and not isinstance(optimizer, Mapping):
            raise TypeError(
                "with a state dict as `model`, pass the optimizer as its state dict "
                "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, opt))"
            )
        raw = {str(k): v for k, v in model.items() if _is_tensor(v)}
        canon = names.canonicalizer(raw)
        out.model = {canon(k): v for k, v in raw.items()}
        out.requires_grad = {
            canon(k): v.requires_grad for k, v in raw.items() if isinstance(v, torch.nn.Parameter)
        }
        if optimizer is not None:
            _state_dict_optimizer(out, optimizer, canon)
        return out
    raise TypeError(f"model must be an nn.Module or a state dict, not {type(model).__name__}")


def model_parts(model: Any) -> list[torch.nn.Module] | None:
    """The modules a model is made of: one, or several parts; None for a state dict.

    Several parts are torchtitan's ``model_parts``: the pipeline stages a rank runs (e.g. under
    an interleaved schedule). Parts keep the whole model's names (a stage holds ``layers.3`` as
    ``layers.3``), so their names never collide; a name held by two parts is refused.
    """
    if (
        isinstance(model, (list, tuple))
        and model
        and all(isinstance(_unwrap(m), torch.nn.Module) for m in model)
    ):
        return [_unwrap(m) for m in model]
    model = _unwrap(model)
    return [model] if isinstance(model, torch.nn.Module) else None


def _same(name: str) -> str:
    return name


def _module_state(
    out: LiveState,
    model: torch.nn.Module,
    first: dict[int, str],
    optimizer: Any,
    model_state: Mapping[str, Any] | None,
) -> Any:
    """Adds one module's tensors to `out`; returns its canonicaliser."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if model_state is not None:
        sd = model_state
    elif has_own_hooks(model):
        sd = live_layout(model)  # as it is held: NOTE: [own state-dict hooks]
    else:
        sd = get_model_state_dict(model)
    raw = {k: v for k, v in sd.items() if _is_tensor(v)}
    canon = model_canonicalizer(model)
    mine = {canon(k): v for k, v in raw.items()}
    mine.update(_zero3_parameters(model, canon, mine, optimizer))
    twice = sorted(set(mine) & set(out.model))
    if twice:
        raise ValueError(
            f"two model parts hold {twice[0]}"
            + (f" (and {len(twice) - 1} more)" if len(twice) > 1 else "")
            + ": parts must hold different tensors (pipeline stages of one model)"
        )
    out.model.update(mine)
    out.buffers.update(_non_persistent(model, canon, mine))
    out.adapters = tuple(dict.fromkeys(out.adapters + _adapter_names(model)))
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn = canon(name)
        out.requires_grad[fqn] = p.requires_grad
        if id(p) in first and first[id(p)] != fqn:
            out.tied[fqn] = first[id(p)]
        else:
            first[id(p)] = fqn
    return canon


def _non_persistent(model: torch.nn.Module, canon: Any, saved: Mapping[str, Any]) -> dict:
    """Buffers the state dict leaves out (``register_buffer(..., persistent=False)``)."""
    out = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        fqn = canon(name)
        if fqn not in saved and isinstance(b, torch.Tensor):
            out[fqn] = b
    return out


def _adapter_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The PEFT adapters of a ``PeftModel`` (its ``peft_config`` dict), read without peft."""
    config = getattr(model, "peft_config", None)
    if isinstance(config, Mapping):
        return tuple(str(k) for k in config)
    return ()


def _unwrap(model: Any) -> Any:
    """The module under Lightning Fabric's _FabricModule (which names every parameter twice).

    The forward module is the one that holds the sharded (or DDP-wrapped) state.
    """
    while (
        isinstance(model, torch.nn.Module)
        and isinstance(getattr(model, "_forward_module", None), torch.nn.Module)
        and isinstance(getattr(model, "_original_module", None), torch.nn.Module)
    ):
        model = model._forward_module
    return model


def model_canonicalizer(model: torch.nn.Module) -> Any:
    """The canonicaliser of a module's names (parameters and buffers, wrappers included)."""
    model = _unwrap(model)
    every = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    every += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    return names.canonicalizer(every)


# -------------------------------------------------------------------------------------------
# NOTE: [own state-dict hooks] A module's own state-dict hooks (torchtitan's FusedQKVLinear
# splits its fused parameter, gathering it first) would run on the shards, and torch's
# get_model_state_dict cannot name what they write: such a model is read as it is held
# (``live_layout``), and its hooks are the model's declared conversion (``convert.declared``
# traces them on meta copies).
def has_own_hooks(model: Any) -> bool:
    """Whether a module of `model` has state-dict hooks of its own (not torch's)."""
    return isinstance(model, torch.nn.Module) and bool(hooked_modules(model))


def live_layout(model: torch.nn.Module) -> dict[str, Any]:
    """The parameters and persistent buffers by their module paths, no hook run.

    What ``state_dict()`` would return without the modules' hooks: nothing is gathered.
    """
    out: dict[str, Any] = {}
    for path, module in _walk(model, ""):
        for name, p in module._parameters.items():
            if p is not None:
                out[path + name] = p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[path + name] = b
    return out


def _walk(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module with its state-dict prefix, in ``state_dict()`` order (shared ones again)."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, prefix + name + ".")


def is_torch_hook(fn: Any) -> bool:
    """Whether a hook is torch's own (FSDP2's pre-hook, FSDP1's, spectral norm's)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return module == "torch" or module.startswith("torch.")


def _own_hooks(module: torch.nn.Module) -> bool:
    hooks = [*module._state_dict_pre_hooks.values(), *module._state_dict_hooks.values()]
    return any(not is_torch_hook(h) for h in hooks)


def hooked_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules with hooks of their own, with their state-dict prefixes."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def visit(module: torch.nn.Module, prefix: str) -> None:
        if id(module) in seen:
            return  # a shared module: its state-dict entries are another path's too
        seen.add(id(module))
        if _own_hooks(module):
            out.append((prefix, module))
            return
        for name, child in module._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(model, "")
    return out


def _zero3_parameters(
    model: torch.nn.Module, canon: Any, live: Mapping[str, Any], optimizer: Any
) -> dict[str, torch.nn.Parameter]:
    """The DeepSpeed ZeRO-3 parameters among `live`'s names: the Parameters themselves.

    NOTE: [ZeRO-3 live] A ZeRO-3 module's state dict holds ``param.detach()``: an empty
    placeholder (or, for a gathered parameter, a full copy) without the ``ds_*`` attributes
    that locate the rank's partition, which ``layout`` reads from the Parameter (NOTE: [ZeRO-3
    partitions]). A parameter whose partition cannot be read, or an optimizer (ZeRO-3 keeps its
    state in flat partitions that are not per-parameter tensors), refuses the call in one line
    rather than one finding per parameter.

    Raises:
        TypeError: Naming what to pass instead.
    """
    found = {
        canon(n): p
        for n, p in model.named_parameters(remove_duplicate=False)
        if is_zero3(p) and canon(n) in live
    }
    if not found:
        return found
    if optimizer is not None:
        raise TypeError(
            "DeepSpeed ZeRO-3 keeps the optimizer state in flat partitions that fsdpcheck does "
            "not map to parameters, so it cannot be verified: call without optimizer= to "
            "verify the model"
        )
    problems = [(k, zero3_problem(p)) for k, p in sorted(found.items())]
    bad = [(k, why) for k, why in problems if why is not None]
    if bad:
        more = f" (and {len(bad) - 1} more parameter(s))" if len(bad) > 1 else ""
        raise TypeError(f"{bad[0][0]}{more}: {bad[0][1]}")
    return found


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a wrapper (or the optimizer itself)."""
    seen: list[torch.optim.Optimizer] = []
    todo = [optimizer]
    while todo:
        o = todo.pop(0)
        inner = getattr(o, "optimizers", None)  # torchtitan OptimizersContainer
        if isinstance(inner, (list, tuple)) and inner and not isinstance(o, Mapping):
            todo = list(inner) + todo
            continue
        for attr in ("_optimizer", "optimizer"):  # Lightning, Fabric, accelerate wrappers
            wrapped = getattr(o, attr, None)
            if isinstance(wrapped, torch.optim.Optimizer) and wrapped is not o:
                todo.insert(0, wrapped)
                break
        else:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer (or a wrapper of some), not "
                    f"{type(o).__name__}"
                )
            seen.append(o)
    return seen


def _read_optimizers(
    out: LiveState,
    parts: list[torch.nn.Module],
    optimizer: Any,
    fqn_of: dict[int, str],
    canons: list[Any],
) -> None:
    optimizers = inner_optimizers(optimizer)
    out.optim_state, out.param_groups = {}, []
    flat = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    if any(id(p) not in fqn_of for p in flat):
        if len(parts) != 1:
            raise ValueError(
                "the optimizer holds parameters that no model part has (FSDP1 flat parameters "
                "are read through torch's state dict API, one model at a time)"
            )
        _torch_optimizer_state(out, parts[0], optimizers)
        return
    fsdp1 = _fsdp1_parameters(parts, canons, fqn_of)
    for oi, opt in enumerate(optimizers):
        if not opt.state and any(
            _may_hold_state(p, fsdp1) for g in opt.param_groups for p in g["params"]
        ):
            where = f" {oi}" if len(optimizers) > 1 else ""
            out.problems.append(
                (
                    "optim.state",
                    "missing",
                    f"the optimizer{where} has no state (never stepped, or its state was not "
                    "loaded): there is nothing to verify; fsdpcheck does not initialise it",
                )
            )
        siblings: dict[int, Mapping[str, Any]] = {}  # per FlatParameter, looked up once
        for g in opt.param_groups:
            params: list[str] = []
            for p in g["params"]:
                st = opt.state.get(p)
                mapped = fsdp1.get(id(p))
                if mapped is None:
                    params.append(fqn_of[id(p)])
                    if st:
                        out.optim_state[params[-1]] = dict(st)
                    continue
                for fqn, info, i in mapped:
                    params.append(fqn)
                    if not st and id(info.flat) not in siblings:
                        siblings[id(info.flat)] = _sibling_state(opt, info)
                    sibling = siblings.get(id(info.flat), {})
                    states = _fsdp1_state(fqn, st, info, i, sibling)
                    if states:
                        out.optim_state[fqn] = states
            out.param_groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": params}
            )


# -------------------------------------------------------------------------------------------
# NOTE: [FSDP1 flat state] FSDP1 steps the optimizer on flat runs: with
# ``use_orig_params=False`` the optimizer holds one FlatParameter per wrapped module and its
# state is this rank's run of the flattened, concatenated parameters (padding included); with
# ``use_orig_params=True`` it holds each original parameter as a 1-D view of its part of the run
# (empty, and then without state, on a rank holding none of it). Either way each original
# parameter's state on a rank is a contiguous range of its row-major index, which the FlatParameter
# records (``_compat.fsdp1_flat_params``): read as a FlatShard, cut into at most 2 * (ndim - 1) + 1
# boxes like a ZeRO-3 partition (NOTE: [ZeRO-3 partitions] in ``layout``), never gathered. (torch's
# own ``FSDP.optim_state_dict`` all-gathers every parameter's state to re-chunk it by rows.)
# 0-d state (``step``) is one value per FlatParameter, or per original parameter on each rank
# holding part of it. Every rank names the same keys: a rank holding none of a parameter under
# ``use_orig_params=True`` names its state (the names and dtypes its FlatParameter's other
# parameters have here) with nothing held, so key lists stay identical on every rank (one digest,
# NOTE: [bytes per rank] in ``collectives``).
_Mapped = list[tuple[str, Any, int]]  # (canonical FQN, FlatParamInfo, index in it)


def _fsdp1_parameters(
    parts: list[torch.nn.Module], canons: list[Any], fqn_of: dict[int, str]
) -> dict[int, _Mapped]:
    """What each parameter the optimizer may hold of an FSDP1 FlatParameter holds, by its id.

    A FlatParameter (``use_orig_params=False``) holds every original parameter it flattens; an
    original parameter (``use_orig_params=True``) holds itself.
    """
    out: dict[int, _Mapped] = {}
    for part, canon in zip(parts, canons):
        for info in _compat.fsdp1_flat_params(part):
            if info.params is not None:
                for i, p in enumerate(info.params):
                    if id(p) in fqn_of:
                        out[id(p)] = [(fqn_of[id(p)], info, i)]
            else:
                fqns = [canon(info.prefix + f) for f in info.fqns]
                out[id(info.flat)] = [(f, info, i) for i, f in enumerate(fqns)]
    return out


def _may_hold_state(p: Any, fsdp1: dict[int, _Mapped]) -> bool:
    """False for an original FSDP1 parameter this rank holds none of (it never has state)."""
    mapped = fsdp1.get(id(p))
    if mapped is None or mapped[0][1].params is None:
        return True
    _, info, i = mapped[0]
    return info.shards[i] is not None


def _sibling_state(opt: torch.optim.Optimizer, info: Any) -> Mapping[str, Any]:
    """Some state of the same FlatParameter's parameters here (else of any), for the names."""
    for p in info.params or ():
        st = opt.state.get(p)
        if st:
            return st
    for st in opt.state.values():
        if st:
            return st
    return {}


def _fsdp1_state(
    fqn: str, st: Mapping[str, Any] | None, info: Any, i: int, sibling: Mapping[str, Any]
) -> dict[str, Any]:
    """One original parameter's state as FlatShards (NOTE: [FSDP1 flat state])."""
    shape, shard = info.shapes[i], info.shards[i]
    start, numel, at = (shard[2], shard[1], shard[0]) if shard is not None else (0, 0, 0)
    replicated = info.replicas > 1
    owner = info.replica_index == 0
    desc = f"FSDP1 {info.strategy} flat shard"
    orig = info.params is not None
    if not st:
        if not orig or shard is not None:
            return {}  # no state where it should be: matching names it as missing
        st = {n: v for n, v in sibling.items() if isinstance(v, torch.Tensor)}
        held = False
    else:
        held = True
    out: dict[str, Any] = {}
    for name, v in st.items():
        if not isinstance(v, torch.Tensor):
            out[name] = v
            continue
        if v.dim() == 0:
            if not orig:
                out[name] = v  # one value per FlatParameter, on every rank
                continue
            # One value per original parameter, on each rank holding part of it: counted once,
            # on the rank holding its first element (ranks hold increasing runs).
            data = v.reshape(1) if held else v.new_empty(0)
            first = held and start == 0 and owner
            out[name] = FlatShard(data, (), 0, True, first, desc)
            continue
        if not held:
            out[name] = FlatShard(v.new_empty(0), shape, 0, replicated, owner, desc)
            continue
        expected = numel if orig else info.local_numel
        if v.dim() != 1 or v.numel() != expected:
            out[name] = FlatShard(
                v.reshape(-1)[:0],
                shape,
                0,
                replicated,
                owner,
                desc,
                error=(
                    f"{desc}: optimizer state of shape {tuple(v.shape)} where the flat run of "
                    f"{fqn} holds {expected} elements: it cannot be mapped to the parameter"
                ),
            )
            continue
        data = v if orig else v.narrow(0, at, numel)
        out[name] = FlatShard(data, shape, start, replicated, owner, desc)
    return out


def _torch_optimizer_state(
    out: LiveState, model: Any, optimizers: list[torch.optim.Optimizer]
) -> None:
    """FSDP1 flat parameters: only torch knows the mapping; ask it only when that is safe."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if any(not o.state for o in optimizers):
        out.problems.append(
            (
                "optim.state",
                "missing",
                "the optimizer has no state (never stepped, or not loaded): there is nothing to "
                "verify; fsdpcheck does not initialise it",
            )
        )
        return
    osd: Any = get_optimizer_state_dict(model, optimizers if len(optimizers) > 1 else optimizers[0])
    canon = names.canonicalizer(n for n, _ in model.named_parameters(remove_duplicate=False))
    _state_dict_optimizer(out, osd, canon)


def _state_dict_optimizer(out: LiveState, osd: Mapping[str, Any], canon: Any) -> None:
    out.optim_state = {
        canon(str(fqn)): dict(states) for fqn, states in dict(osd.get("state", {})).items()
    }
    out.param_groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [canon(str(p)) for p in g.get("params", [])],
        }
        for g in osd.get("param_groups", [])
    ]


def flat_live(model: Any, optimizer: Any = None) -> dict[str, torch.Tensor]:
    """Every live tensor by canonical name (model FQNs and ``optim.state.<fqn>.<name>``)."""
    return live_state(model, optimizer).tensors()
