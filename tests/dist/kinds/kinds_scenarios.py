"""Tensors that cannot be compared element-wise, held by every rank of a 2-rank job.

Each is one finding naming its key and kind, the same on every rank (no rank named: every rank
holds it), and the rest of the model (a sharded DTensor, a plain tensor) is still checked.
"""

from __future__ import annotations

from typing import Any

import torch

import fsdpcheck
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario
REGISTRY.setup = lambda rank, world, shared, saved_by: ({}, None)


class Opaque(torch.Tensor):
    """A wrapper subclass that keeps no data fsdpcheck can see (it refuses every op)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...]) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)  # type: ignore[attr-defined]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"Opaque holds no data ({func})")


class Wrapped(torch.Tensor):
    """A wrapper subclass around one plain tensor of its shape (torchao's float8 weight wrapper)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self._tensor = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Wrapped:
        return Wrapped(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x._tensor if isinstance(x, Wrapped) else x

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def kinds() -> dict[str, torch.Tensor]:
    """One tensor of each kind fsdpcheck cannot read as a dense array (3 x 4 where it has one)."""
    d = torch.arange(12.0).reshape(3, 4)
    strided9 = torch.arange(float(3**9 * 2)).reshape([3] * 9 + [2])[..., 0]
    return {
        "sparse_coo": d.to_sparse(),
        "sparse_csr": d.to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(d, 0.1, 0, torch.qint8),
        "meta": torch.empty(3, 4, device="meta"),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "opaque": Opaque((3, 4)),
        "nine_d": strided9.permute(8, 7, 6, 5, 4, 3, 2, 1, 0),
    }


@scenario(2)
def every_kind(w: World) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (w.size,))
    full = torch.arange(24.0).reshape(6, 4)
    live: dict[str, Any] = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "plain": torch.ones(5),
        "wrapped": Wrapped(torch.arange(12.0).reshape(3, 4)),
    }
    ref: dict[str, Any] = {
        "sharded": full,
        "plain": torch.ones(5),
        "wrapped": torch.arange(12.0).reshape(3, 4),
    }
    for name, t in kinds().items():
        live[f"bad.{name}"] = t
        ref[f"bad.{name}"] = (
            torch.zeros(tuple(t.shape)) if name not in ("nested", "jagged") else torch.zeros(2)
        )
    r = fsdpcheck.verify(live, ref)
    planted = dict(live, plain=torch.tensor([1.0, 1, 1, 7, 1]))
    bad = fsdpcheck.verify(planted, ref)
    try:
        fsdpcheck.fingerprint(live)
        fp_error = None
    except fsdpcheck.FingerprintError as exc:
        fp_error = str(exc)
    return {
        "ok": r.ok,
        "findings": [[f.key, f.kind, f.rank, f.message] for f in r.findings],
        "checked": r.keys_checked,
        "planted": [[f.key, f.kind, list(f.max_abs_index or [])] for f in bad.findings],
        "fingerprint_error": fp_error,
        "wrapped_fp": fsdpcheck.fingerprint({"wrapped": live["wrapped"]})["wrapped"],
        "plain_fp": fsdpcheck.fingerprint({"wrapped": ref["wrapped"]})["wrapped"],
    }
