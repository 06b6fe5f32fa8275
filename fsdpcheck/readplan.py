"""Read planning: row blocks under a memory budget, and the arena reads are carved from."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def row_blocks(
    offset: Sequence[int], size: Sequence[int], itemsize: int, budget: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A box cut along dim 0 into blocks of at most `budget` bytes (at least one row each).

    Args:
        offset: The box's offset in the global tensor.
        size: The box's size.
        itemsize: Bytes per element.
        budget: Bytes per block.

    Returns:
        (offset, size) of each block, in order; the box itself when it fits, is 0-d, or has at
        most one row.
    """
    offset, size = tuple(offset), tuple(size)
    if not size or size[0] <= 1 or math.prod(size) * itemsize <= budget:
        return [(offset, size)]
    row = max(1, math.prod(size[1:]) * itemsize)
    rows = max(1, budget // row)
    out = []
    for r0 in range(0, size[0], rows):
        r1 = min(size[0], r0 + rows)
        out.append(((offset[0] + r0, *offset[1:]), (r1 - r0, *size[1:])))
    return out


class Arena:
    """One reusable buffer per device that every batch's reference regions are carved from.

    NOTE: [arena] Allocating fresh buffers for every batch costs a page fault per 4 KiB on the
    CPU (more than the comparison itself) and allocator churn on the GPU; one buffer of at most
    the memory budget, reused, costs that once. Host buffers start on a page boundary (byte-range
    reads land on whole pages) and can be page-locked (`pin`) for asynchronous copies to a GPU.
    """

    _ALIGN = 64  # bytes: keeps every region 16-byte aligned for vector loads

    def __init__(self, pin: bool = False) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.pin = pin

    def carve(
        self,
        device: torch.device,
        specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
        *,
        fresh: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Uninitialised tensors of the given shapes and dtypes, valid until the next carve.

        Args:
            device: Where the tensors live.
            specs: (shape, dtype) of each tensor.
            fresh: Called right after a new buffer is allocated (a first carve, or one larger
                than the buffer): its memory may be in use by work queued on the current stream
                until then (NOTE: [stream order] in sources/prefetch.py).
        """
        sizes = [dtype.itemsize * math.prod(shape) for shape, dtype in specs]
        total = sum(-(-n // self._ALIGN) * self._ALIGN for n in sizes)
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < total:
            self.buffers.pop(device, None)  # free the old one first
            if device.type == "cpu":
                from fsdpcheck.sources.rawio import aligned_empty

                buf = aligned_empty(max(total, 1), pin=self.pin)
            else:
                buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            self.buffers[device] = buf
            if fresh is not None:
                fresh()
        out, off = [], 0
        for (shape, dtype), n in zip(specs, sizes):
            out.append(buf[off : off + n].view(dtype).view(shape))
            off += -(-n // self._ALIGN) * self._ALIGN
        return out


def batches(items: Sequence[T], nbytes: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """Consecutive runs of `items` of at most `budget` bytes each (at least one item each)."""
    batch: list[T] = []
    held = 0
    for it in items:
        n = nbytes(it)
        if batch and held + n > budget:
            yield batch
            batch, held = [], 0
        batch.append(it)
        held += n
    if batch:
        yield batch
