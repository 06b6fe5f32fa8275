"""Where a local tensor sits inside its global tensor."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """The global shape and the per-dim offset of a local tensor's first element.

    A local shard ``full[o0:o0+s0, o1:o1+s1, ...]`` of a global tensor ``full`` is described by
    ``Box(full.shape, (o0, o1, ...))``. Global indices are row-major linear (or multi-) indices
    in ``shape``.

    Args:
        shape: The global tensor's shape.
        offset: The global index of the local tensor's first element along each dim; ``None``
            means all zeros.
    """

    shape: tuple[int, ...]
    offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        shape = _int_tuple(self.shape, "shape")
        offset = (0,) * len(shape) if self.offset is None else _int_tuple(self.offset, "offset")
        if len(offset) != len(shape):
            raise ValueError(
                f"Box: shape {shape} has {len(shape)} dims but offset {offset} has {len(offset)}"
            )
        if any(s < 0 for s in shape) or any(o < 0 for o in offset):
            raise ValueError(f"Box: negative shape or offset (shape {shape}, offset {offset})")
        if any(o > s for o, s in zip(offset, shape)):
            raise ValueError(f"Box: offset {offset} lies outside the global shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "offset", offset)

    @property
    def ndim(self) -> int:
        """Number of dims of the global (and local) tensor."""
        return len(self.shape)

    def contains(self, local_shape: Sequence[int]) -> bool:
        """Whether a local tensor of ``local_shape`` at this offset fits in the global shape."""
        assert self.offset is not None
        return len(local_shape) == len(self.shape) and all(
            o + s <= g for o, s, g in zip(self.offset, local_shape, self.shape)
        )

    def unravel(self, linear_index: int) -> tuple[int, ...]:
        """The global multi-index of a global row-major linear index."""
        return unravel(linear_index, self.shape)


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    """The row-major linear index of a multi-index in ``shape``."""
    out = 0
    for i, g in zip(index, shape):
        out = out * g + i
    return out


def unravel(linear_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The multi-index of a row-major linear index in ``shape``."""
    if len(shape) == 1:
        return (linear_index,)
    out = []
    for g in reversed(shape):
        linear_index, r = divmod(linear_index, g) if g else (linear_index, 0)
        out.append(r)
    return tuple(reversed(out))


def _int_tuple(values: Sequence[int], name: str) -> tuple[int, ...]:
    """`values` as ints, refusing anything that is not an integer (1.5, 2.0, True, "3")."""
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"Box: {name} must be a sequence of ints, got {values!r}") from None
    out = []
    for v in items:
        # operator.index accepts ints and integer scalars (numpy, 0-d integer tensors) and
        # refuses floats, which int() would truncate; bools are ints to Python but never sizes.
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"Box: {name} must be a sequence of ints, got {type(v).__name__} {v!r} in {items}"
            ) from None
    return tuple(out)
