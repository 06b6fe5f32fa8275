"""fsdpcheck: prove that every rank's shard of a sharded checkpoint holds the right values."""

from __future__ import annotations

from fsdpcheck.box import Box
from fsdpcheck.kernels import (
    SUPPORTED_DTYPES,
    TensorDiff,
    build_info,
    compare,
    fingerprint_tensor,
    fingerprint_tensors,
)
from fsdpcheck.report import Finding, Report, VerificationError
from fsdpcheck.verify import verify

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "Box",
    "Finding",
    "Report",
    "TensorDiff",
    "VerificationError",
    "__version__",
    "build_info",
    "compare",
    "fingerprint_tensor",
    "fingerprint_tensors",
    "verify",
]
