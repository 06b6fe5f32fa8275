"""Planted faults: the classic ways a sharded load goes wrong, each undone on exit.

Every fault is a context manager. Inside the ``with`` block the model, optimizer or file holds
the fault; on exit (also on an exception) the exact original bits are back, so one model or one
checkpoint can carry many faults one after another::

    with plant(model.get_parameter("w"), (3, 7), on_rank=1):
        report = fsdpcheck.verify(model, ckpt_dir)
    assert {f.key for f in report.findings} == {"w"}

`on_rank` (where a fault takes it) limits the fault to that rank of the default process group;
the other ranks enter and leave the block without changing anything, so every rank runs the same
code, as the collective calls inside the block require.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from fsdpcheck.testing.models import local_of

# Integer dtypes of each element size, to flip bits of any dtype in place.
_BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _acts(on_rank: int | None) -> bool:
    return on_rank is None or _rank() == on_rank


def _barrier(on_rank: int | None) -> None:
    import torch.distributed as dist

    if on_rank is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()


def _index(local: torch.Tensor, index: int | tuple[int, ...]) -> tuple[int, ...]:
    """A local index as a tuple; an int is a row-major index into the flattened shard."""
    if isinstance(index, int):
        if not -local.numel() <= index < local.numel():
            raise IndexError(f"flat index {index} is outside a shard of {local.numel()} elements")
        index %= max(local.numel(), 1)
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(index), local.shape))
    return tuple(index)


@contextlib.contextmanager
def _restored(local: torch.Tensor, saved: torch.Tensor) -> Iterator[None]:
    """Puts `saved` back into `local` on exit, however the block ends."""
    try:
        yield
    finally:
        with torch.no_grad():
            local.copy_(saved)


@contextlib.contextmanager
def plant(
    tensor: torch.Tensor,
    index: int | tuple[int, ...],
    *,
    delta: float = 1.0,
    value: float | None = None,
    on_rank: int | None = None,
) -> Iterator[None]:
    """One element of this rank's shard changed: ``+= delta``, or set to `value`.

    Args:
        tensor: A parameter, buffer, optimizer state tensor or any tensor; for a DTensor the
            element is in the local shard (``to_local()``).
        index: The element's index in the local shard (a tuple), or a row-major index into the
            flattened shard (an int).
        delta: Added to the element (ignored when `value` is given).
        value: The element's new value.
        on_rank: Only this rank plants the fault (None: every caller).
    """
    local = local_of(tensor)
    if not _acts(on_rank):
        yield
        return
    at = _index(local, index)
    saved = local[at].detach().clone()
    with torch.no_grad():
        if value is None:
            local[at] += delta
        else:
            local[at] = value
    try:
        yield
    finally:
        with torch.no_grad():
            local[at] = saved


@contextlib.contextmanager
def flip_bit(
    tensor: torch.Tensor, index: int = 0, bit: int = 0, *, on_rank: int | None = None
) -> Iterator[None]:
    """One bit of one element of this rank's shard flipped (raw bits, any dtype).

    A change that value comparisons with a tolerance may accept (the lowest mantissa bit) but a
    fingerprint never does.

    Args:
        tensor: Any tensor or DTensor (its local shard); it must be contiguous.
        index: A row-major index into the flattened local shard.
        bit: Which bit of the element, 0 the least significant.
        on_rank: Only this rank flips it (None: every caller).
    """
    local = local_of(tensor)
    if not _acts(on_rank):
        yield
        return
    size = local.element_size()
    if not local.is_contiguous() or size not in _BITS_OF or not 0 <= bit < 8 * size:
        raise ValueError(
            f"flip_bit needs a contiguous tensor of 1, 2, 4 or 8-byte elements and a bit below "
            f"{8 * size} (got {local.dtype}, bit {bit}, contiguous={local.is_contiguous()})"
        )
    bits = local.detach().view(-1).view(_BITS_OF[size])
    value = 1 << bit
    if size > 1 and bit == 8 * size - 1:
        value -= 1 << (8 * size)  # the sign bit of a signed integer: two's complement
    mask = torch.tensor(value, dtype=_BITS_OF[size], device=local.device)
    bits[index] ^= mask
    try:
        yield
    finally:
        bits[index] ^= mask


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    import torch.distributed as dist

    # gloo's send/recv read host memory: ranks sharing GPUs over gloo stage through the host.
    staged = send.is_cuda and dist.get_backend() == "gloo"
    out, into = (send.cpu(), torch.empty_like(recv, device="cpu")) if staged else (send, recv)
    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    if staged:
        recv.copy_(into)


@contextlib.contextmanager
def swap_shards(tensor: torch.Tensor, ranks: tuple[int, int] = (0, 1)) -> Iterator[None]:
    """Two ranks' local shards exchanged (chunks that landed on the wrong rank).

    Collective for the two ranks in `ranks` (the others do nothing). Shards need not be the same
    size: FSDP2 splits rows as ``torch.chunk`` does, so neighbours often differ by a row. The
    first ``min(n0, n1)`` elements (row-major) are exchanged and the rest of the larger shard is
    left as it was.

    Args:
        tensor: A DTensor (or each rank's own plain tensor) of the same dtype on both ranks.
        ranks: The two ranks, in the default process group.
    """
    import torch.distributed as dist

    if ranks[0] == ranks[1]:
        raise ValueError(f"swap_shards needs two different ranks, not {ranks}")
    local = local_of(tensor)
    rank = dist.get_rank()
    if rank not in ranks:
        yield
        return
    peer = ranks[1] if rank == ranks[0] else ranks[0]
    saved = local.detach().clone()
    mine = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    theirs = torch.empty_like(mine)
    _exchange(mine, theirs, peer)
    n = min(local.numel(), int(theirs.item()))
    if n:  # both ranks know n, so both skip an empty exchange
        out = saved.reshape(-1)[:n].contiguous()
        into = torch.empty_like(out)
        _exchange(out, into, peer)
        flat = local.detach().reshape(-1)
        with torch.no_grad():
            if flat.data_ptr() == local.data_ptr() and local.is_contiguous():
                flat[:n] = into
            else:  # not viewable as flat: rebuild the shard and copy it back in place
                whole = saved.reshape(-1).clone()
                whole[:n] = into
                local.copy_(whole.reshape(local.shape))
    with _restored(local, saved):
        yield


@contextlib.contextmanager
def shift_shard(
    tensor: torch.Tensor, shifts: int = 1, dim: int = 0, *, on_rank: int | None = None
) -> Iterator[None]:
    """This rank's shard rolled by `shifts` along `dim` (rows at the wrong offset).

    ``torch.roll`` semantics: the rows that fall off one end come back at the other.

    Args:
        tensor: A DTensor or tensor (its local shard is rolled in place).
        shifts: How far.
        dim: Along which local dimension.
        on_rank: Only this rank shifts its shard (None: every caller).
    """
    local = local_of(tensor)
    if not _acts(on_rank):
        yield
        return
    saved = local.detach().clone()
    with torch.no_grad():
        local.copy_(torch.roll(saved, shifts, dims=dim))
    with _restored(local, saved):
        yield


def _state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    if param not in optimizer.state or not optimizer.state[param]:
        raise KeyError(
            "the optimizer holds no state for this parameter (take a step first, and pass the "
            "parameter object the optimizer was built with)"
        )
    return optimizer.state[param]


@contextlib.contextmanager
def zero_moment(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    name: str = "exp_avg_sq",
    *,
    on_rank: int | None = None,
) -> Iterator[None]:
    """One optimizer state tensor of one parameter zeroed (a moment reset on resume).

    Args:
        optimizer: A torch optimizer with state (after a step).
        param: The parameter (the object in ``optimizer.param_groups``, e.g.
            ``model.get_parameter(fqn)``).
        name: The state entry, e.g. "exp_avg" or "exp_avg_sq" for Adam.
        on_rank: Only this rank zeroes its shard (None: every caller).
    """
    value = _state_of(optimizer, param)[name]
    local = local_of(value)
    if not _acts(on_rank):
        yield
        return
    saved = local.detach().clone()
    with torch.no_grad():
        local.zero_()
    with _restored(local, saved):
        yield


@contextlib.contextmanager
def drop_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    name: str = "step",
    *,
    on_rank: int | None = None,
) -> Iterator[None]:
    """One optimizer state entry of one parameter removed (e.g. a checkpoint without a step).

    Save inside the block to write a checkpoint that lacks the entry; verify inside it to see a
    live optimizer that lacks it. The entry comes back on exit, in its place.

    Args:
        optimizer: A torch optimizer with state (after a step).
        param: The parameter (the object in ``optimizer.param_groups``).
        name: The state entry ("step", "exp_avg", ...).
        on_rank: Only this rank drops it (None: every caller).
    """
    state = _state_of(optimizer, param)
    if name not in state:
        raise KeyError(f"the optimizer state has no {name!r} (it has {sorted(state)})")
    if not _acts(on_rank):
        yield
        return
    items = list(state.items())
    del state[name]
    try:
        yield
    finally:
        state.clear()
        state.update(items)  # the original order: state dicts list entries in it


def drop_step(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, *, on_rank: int | None = None
) -> contextlib.AbstractContextManager[None]:
    """``drop_state(optimizer, param, "step")``: the step counter missing for one parameter."""
    return drop_state(optimizer, param, "step", on_rank=on_rank)


def find_bytes(path: str | os.PathLike[str], tensor: torch.Tensor) -> int:
    """Where a tensor's raw bytes start inside a file (e.g. a shard inside a ``.distcp``).

    Meant for small test tensors: the bytes are built on the host.

    Raises:
        ValueError: The bytes are not in the file.
    """
    local = local_of(tensor).detach().cpu().contiguous()
    raw = bytes(local.reshape(-1).view(torch.uint8).tolist())
    at = Path(path).read_bytes().find(raw)
    if at < 0 or not raw:
        raise ValueError(f"the tensor's {len(raw)} bytes are not in {path}")
    return at


def _file_fault(path: Path, new: bytes | None, on_rank: int | None) -> Iterator[None]:
    acts = _acts(on_rank)
    original = path.read_bytes() if acts else b""
    if acts and new is not None:
        path.write_bytes(new)
    _barrier(on_rank)  # every rank sees the fault before it reads
    try:
        yield
    finally:
        _barrier(on_rank)  # nobody is still reading when the file is restored
        if acts:
            path.write_bytes(original)
        _barrier(on_rank)


@contextlib.contextmanager
def flip_byte(
    path: str | os.PathLike[str], offset: int, mask: int = 0x01, *, on_rank: int | None = None
) -> Iterator[None]:
    """One byte of a file XOR-ed with `mask` (silent corruption on disk).

    With `on_rank` only that rank edits the file and every rank waits at a barrier on entry and
    exit (a collective of the default group), so all of them read the fault and the restored file.

    Args:
        path: The file.
        offset: Which byte; negative counts from the end.
        mask: The bits to flip (1..255).
        on_rank: Only this rank edits (for a file every rank shares); None: every caller.
    """
    p = Path(path)
    if not 1 <= mask <= 255:
        raise ValueError(f"mask must flip at least one bit of a byte (1..255), not {mask}")
    new = None
    if _acts(on_rank):
        data = bytearray(p.read_bytes())
        if not -len(data) <= offset < len(data):
            raise IndexError(f"byte {offset} is outside {p} ({len(data)} bytes)")
        data[offset] ^= mask
        new = bytes(data)
    yield from _file_fault(p, new, on_rank)


@contextlib.contextmanager
def truncate(
    path: str | os.PathLike[str], size: int, *, on_rank: int | None = None
) -> Iterator[None]:
    """A file cut short: its first `size` bytes kept (negative: that many dropped from the end).

    With `on_rank`, as for ``flip_byte``: one rank edits, every rank meets at barriers.
    """
    p = Path(path)
    new = None
    if _acts(on_rank):
        data = p.read_bytes()
        new = data[:size]
        if len(new) == len(data):
            raise ValueError(f"truncating {p} ({len(data)} bytes) to {size} changes nothing")
    yield from _file_fault(p, new, on_rank)
