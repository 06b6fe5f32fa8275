"""fsdpcheck: prove that every rank's shard of a sharded checkpoint holds the right values."""

from __future__ import annotations

from fsdpcheck._version import __version__
from fsdpcheck.audit import audit
from fsdpcheck.box import Box
from fsdpcheck.checkpoint import CheckpointKindError, load, save
from fsdpcheck.comparison import compare_checkpoints
from fsdpcheck.fingerprints import (
    FingerprintError,
    check_replicas,
    fingerprint,
    fingerprint_checkpoint,
)
from fsdpcheck.formats import CheckpointInfo, describe_path
from fsdpcheck.kernels import (
    SUPPORTED_DTYPES,
    TensorDiff,
    build_info,
    compare,
    fingerprint_tensor,
    fingerprint_tensors,
)
from fsdpcheck.manifest import Manifest, ManifestError, read_manifest
from fsdpcheck.report import Finding, MappingRow, Report, VerificationError
from fsdpcheck.verification import verify

__all__ = [
    "SUPPORTED_DTYPES",
    "Box",
    "CheckpointInfo",
    "CheckpointKindError",
    "Finding",
    "FingerprintError",
    "Manifest",
    "ManifestError",
    "MappingRow",
    "Report",
    "TensorDiff",
    "VerificationError",
    "__version__",
    "audit",
    "build_info",
    "check_replicas",
    "compare",
    "compare_checkpoints",
    "describe_path",
    "fingerprint",
    "fingerprint_checkpoint",
    "fingerprint_tensor",
    "fingerprint_tensors",
    "load",
    "read_manifest",
    "save",
    "verify",
]
