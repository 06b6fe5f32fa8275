"""fsdpcheck: prove that every rank's shard of a sharded checkpoint holds the right values.

The public names are imported on first use (PEP 562), so ``fsdpcheck --help`` and
``import fsdpcheck`` do not pay for torch.distributed.checkpoint until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fsdpcheck._version import __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "audit": "fsdpcheck.auditing",
    "Box": "fsdpcheck.box",
    "CheckpointError": "fsdpcheck.errors",
    "CheckpointKindError": "fsdpcheck.errors",
    "FsdpcheckError": "fsdpcheck.errors",
    "RankStoppedError": "fsdpcheck.errors",
    "RanksDisagreeError": "fsdpcheck.errors",
    "ConcurrentCallError": "fsdpcheck.errors",
    "prefix_rules": "fsdpcheck.matching",
    "load": "fsdpcheck.loading",
    "save": "fsdpcheck.saving",
    "compare_checkpoints": "fsdpcheck.comparison",
    "FingerprintError": "fsdpcheck.errors",
    "check_replicas": "fsdpcheck.fingerprints",
    "fingerprint": "fsdpcheck.fingerprints",
    "fingerprint_checkpoint": "fsdpcheck.fingerprints",
    "CheckpointInfo": "fsdpcheck.formats",
    "describe_path": "fsdpcheck.formats",
    "SUPPORTED_DTYPES": "fsdpcheck.kernels",
    "TensorDiff": "fsdpcheck.kernels",
    "build_info": "fsdpcheck.kernels",
    "compare": "fsdpcheck.kernels",
    "fingerprint_tensor": "fsdpcheck.kernels",
    "fingerprint_tensors": "fsdpcheck.kernels",
    "Manifest": "fsdpcheck.manifest",
    "ManifestError": "fsdpcheck.errors",
    "read_manifest": "fsdpcheck.manifest",
    "Finding": "fsdpcheck.report",
    "MappingRow": "fsdpcheck.report",
    "Report": "fsdpcheck.report",
    "VerificationError": "fsdpcheck.errors",
    "verify": "fsdpcheck.verification",
    "ReplicaWatch": "fsdpcheck.watch",
}

__all__ = [
    "SUPPORTED_DTYPES",
    "Box",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointKindError",
    "ConcurrentCallError",
    "Finding",
    "FingerprintError",
    "FsdpcheckError",
    "Manifest",
    "ManifestError",
    "MappingRow",
    "RankStoppedError",
    "RanksDisagreeError",
    "ReplicaWatch",
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
    "prefix_rules",
    "read_manifest",
    "save",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from fsdpcheck.auditing import audit
    from fsdpcheck.box import Box
    from fsdpcheck.comparison import compare_checkpoints
    from fsdpcheck.errors import (
        CheckpointError,
        CheckpointKindError,
        ConcurrentCallError,
        FingerprintError,
        FsdpcheckError,
        ManifestError,
        RanksDisagreeError,
        RankStoppedError,
        VerificationError,
    )
    from fsdpcheck.fingerprints import check_replicas, fingerprint, fingerprint_checkpoint
    from fsdpcheck.formats import CheckpointInfo, describe_path
    from fsdpcheck.kernels import (
        SUPPORTED_DTYPES,
        TensorDiff,
        build_info,
        compare,
        fingerprint_tensor,
        fingerprint_tensors,
    )
    from fsdpcheck.loading import load
    from fsdpcheck.manifest import Manifest, read_manifest
    from fsdpcheck.matching import prefix_rules
    from fsdpcheck.report import Finding, MappingRow, Report
    from fsdpcheck.saving import save
    from fsdpcheck.verification import verify
    from fsdpcheck.watch import ReplicaWatch
