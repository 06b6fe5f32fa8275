"""fsdpcheck: prove that every rank's shard of a sharded checkpoint holds the right values."""

from __future__ import annotations

from fsdpcheck.audit import audit
from fsdpcheck.box import Box
from fsdpcheck.checkpoint import CheckpointKindError, load, read_manifest, save
from fsdpcheck.fingerprint import (
    FingerprintError,
    check_replicas,
    fingerprint,
    fingerprint_checkpoint,
)
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
    "CheckpointKindError",
    "Finding",
    "FingerprintError",
    "Report",
    "TensorDiff",
    "VerificationError",
    "__version__",
    "audit",
    "build_info",
    "check_replicas",
    "compare",
    "fingerprint",
    "fingerprint_checkpoint",
    "fingerprint_tensor",
    "fingerprint_tensors",
    "load",
    "read_manifest",
    "save",
    "verify",
]
