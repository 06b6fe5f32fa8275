"""Counting the collectives a block of code makes, and the bytes each rank receives.

``count_collectives()`` wraps ``torch.distributed.<fn>`` and
``torch.distributed.distributed_c10d.<fn>`` for every collective torch offers while the block
runs. A call made from outside torch.distributed counts once, under the origin of its caller:
"fsdpcheck" (a module of this package), "dcp" (``torch.distributed.checkpoint``: DCP's planner
and the state-dict helpers) or the caller's top-level module ("torch", "torchtitan", ...). An
object collective (``all_gather_object``, ...) runs tensor collectives underneath: those are
not calls of their own, but their buffers are the bytes it moves, counted under the same origin.

Bytes received are the bytes of the result buffers a collective fills on this rank, its own
contribution included: an all-reduce of n bytes receives n, an all-gather W x n, a broadcast
n on every rank but the source, a gather W x n on the destination only. That is what grows
with the world size when something is gathered from every rank (``all_gather_object`` pads
every rank to the largest pickle, so each rank receives W x the largest).

Example::

    with count_collectives() as counts:
        fsdpcheck.verify(model, path)
    counts.calls("fsdpcheck"), counts.bytes("fsdpcheck"), counts.bytes("dcp")

Only calls through those two module attributes are seen (code that bound a collective to a
name of its own at import time is not); the wrappers are removed when the block ends.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveCounts", "count_collectives"]

# Tensor collectives: the name -> how many bytes of result this rank receives, from the bound
# arguments (``a``) and whether this rank is the call's source/destination (``me``).
_TENSOR: dict[str, Callable[[dict[str, Any], Callable[[str, str], bool]], int]] = {
    "all_reduce": lambda a, me: _nbytes(a["tensor"]),
    "all_reduce_coalesced": lambda a, me: _nbytes(a["tensors"]),
    "all_gather": lambda a, me: _nbytes(a["tensor_list"]),
    "all_gather_coalesced": lambda a, me: _nbytes(a["output_tensor_lists"]),
    "all_gather_into_tensor": lambda a, me: _nbytes(a["output_tensor"]),
    "_all_gather_base": lambda a, me: _nbytes(a["output_tensor"]),
    "reduce_scatter": lambda a, me: _nbytes(a["output"]),
    "reduce_scatter_tensor": lambda a, me: _nbytes(a["output"]),
    "_reduce_scatter_base": lambda a, me: _nbytes(a["output"]),
    "all_to_all": lambda a, me: _nbytes(a["output_tensor_list"]),
    "all_to_all_single": lambda a, me: _nbytes(a["output"]),
    "broadcast": lambda a, me: 0 if me("src", "group_src") else _nbytes(a["tensor"]),
    "reduce": lambda a, me: _nbytes(a["tensor"]) if me("dst", "group_dst") else 0,
    "gather": lambda a, me: _nbytes(a.get("gather_list")) if me("dst", "group_dst") else 0,
    "scatter": lambda a, me: _nbytes(a["tensor"]),
    "recv": lambda a, me: _nbytes(a["tensor"]),
    "irecv": lambda a, me: _nbytes(a["tensor"]),
    "send": lambda a, me: 0,
    "isend": lambda a, me: 0,
    "batch_isend_irecv": lambda a, me: 0,  # its P2POps call isend/irecv, counted there
    "barrier": lambda a, me: 0,
    "monitored_barrier": lambda a, me: 0,
}
# Object collectives: counted as calls; their bytes are those of the tensor collectives inside.
_OBJECT = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


@dataclass
class CollectiveCounts:
    """What a block's collectives moved on this rank, by origin.

    Attributes:
        by_op: (origin, op name) -> [calls, bytes received]. Calls count the collectives made
            from outside torch.distributed; the tensor collectives inside an object collective
            add their bytes to it under the outer call's name.
    """

    by_op: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def calls(self, origin: str | None = None) -> int:
        """Collectives called (from `origin`, or from anywhere)."""
        return sum(c for (o, _), (c, _) in self.by_op.items() if origin in (None, o))

    def bytes(self, origin: str | None = None) -> int:
        """Bytes received (from collectives of `origin`, or of any)."""
        return sum(b for (o, _), (_, b) in self.by_op.items() if origin in (None, o))

    def origins(self) -> list[str]:
        """The origins seen."""
        return sorted({o for o, _ in self.by_op})

    def ops(self, origin: str) -> dict[str, list[int]]:
        """Op name -> [calls, bytes] for one origin."""
        return {op: list(v) for (o, op), v in sorted(self.by_op.items()) if o == origin}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: origin -> {"calls", "bytes", "ops": {op: [calls, bytes]}}."""
        return {
            o: {"calls": self.calls(o), "bytes": self.bytes(o), "ops": self.ops(o)}
            for o in self.origins()
        }


_TESTING = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DISTRIBUTED = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep
_C10D_FILES = {
    os.path.join(_DISTRIBUTED, f) for f in ("distributed_c10d.py", "c10d_logger.py", "__init__.py")
}
_CHECKPOINT = os.path.join(_DISTRIBUTED, "checkpoint") + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HERE = os.path.abspath(__file__)


def _origin(frame: Any) -> str:
    """Who called the collective: the first frame outside torch.distributed's c10d layer."""
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name not in _C10D_FILES and name != _HERE:
            break
        frame = frame.f_back
    if frame is None:
        return "unknown"
    name = os.path.abspath(frame.f_code.co_filename)
    if name.startswith(_TESTING):
        return "fsdpcheck.testing"
    if name.startswith(_PACKAGE):
        return "fsdpcheck"
    if name.startswith(_CHECKPOINT):
        return "dcp"
    if name.startswith(_TORCH):
        return "torch"
    module = frame.f_globals.get("__name__", "") or "unknown"
    return module.split(".", 1)[0]


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Counts every torch.distributed collective made inside the block (see the module doc)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts = CollectiveCounts()
    state = threading.local()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(name: str, original: Any) -> Any:
        sig = inspect.signature(original)
        bytes_of = _TENSOR.get(name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(state, "origin", None)
            if outer is None:
                origin = _origin(sys._getframe(1))
                row = counts.by_op.setdefault((origin, name), [0, 0])
                row[0] += 1
                state.origin, state.row = origin, row
            try:
                if bytes_of is not None:
                    bound = sig.bind(*args, **kwargs)
                    bound.apply_defaults()
                    a = bound.arguments

                    def me(global_key: str, group_key: str) -> bool:
                        if a.get(group_key) is not None:
                            return dist.get_rank(a.get("group")) == a[group_key]
                        return dist.get_rank() == a.get(global_key)

                    state.row[1] += bytes_of(a, me)
                return original(*args, **kwargs)
            finally:
                if outer is None:
                    state.origin = None

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    try:
        for name in (*_TENSOR, *_OBJECT):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = wrap(name, original)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapper)
        yield counts
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
