"""The fsdpcheck manifest (``fsdpcheck_manifest.json``): typed, validated before any use.

Written by ``fsdpcheck.save`` next to a DCP checkpoint; holds per key its Fingerprint v1,
global shape, dtype and checkpoint key. A manifest is data from a file someone else may have
written: it is parsed as JSON only, and every field is checked (one line naming the field)
before anything reads it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "fsdpcheck_manifest.json"
MANIFEST_FORMAT = "fsdpcheck-manifest"
MANIFEST_VERSION = 1
_MAX_BYTES = 256 << 20  # a manifest of a 10**6-tensor checkpoint is ~200 MB; refuse beyond


class ManifestError(ValueError):
    """A manifest that is not valid (the message names the file and the field)."""


@dataclass(frozen=True)
class ManifestEntry:
    """One tensor of the manifest."""

    checkpoint_key: str
    shape: tuple[int, ...]
    dtype: str
    fingerprint: int | None


@dataclass
class Manifest:
    """A parsed and validated manifest."""

    kind: str
    storage: str
    world_size: int
    entries: dict[str, ManifestEntry]
    meshes: list[str] = field(default_factory=list)
    torch: str = ""
    fsdpcheck: str = ""
    created: str = ""
    format_version: int = MANIFEST_VERSION
    #: Tied duplicate name -> the name it is tied to (listed once in ``entries``).
    tied: dict[str, str] = field(default_factory=dict)
    findings_at_save: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The on-disk form."""
        return {
            "format": MANIFEST_FORMAT,
            "format_version": self.format_version,
            "kind": self.kind,
            "storage": self.storage,
            "world_size": self.world_size,
            "meshes": self.meshes,
            "torch": self.torch,
            "fsdpcheck": self.fsdpcheck,
            "created": self.created,
            "entries": {
                k: {
                    "checkpoint_key": e.checkpoint_key,
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "fingerprint": None if e.fingerprint is None else f"{e.fingerprint:#018x}",
                }
                for k, e in sorted(self.entries.items())
            },
            "tied": dict(sorted(self.tied.items())),
            "findings_at_save": self.findings_at_save,
        }

    def fingerprints(self) -> dict[str, int]:
        """Key -> fingerprint, for the entries that have one."""
        return {k: e.fingerprint for k, e in self.entries.items() if e.fingerprint is not None}


def read_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of a checkpoint directory, or None when it has none.

    Raises:
        ManifestError: The manifest exists but is not a valid fsdpcheck manifest.
    """
    f = Path(path) / MANIFEST_NAME
    try:
        st = f.stat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ManifestError(f"{f} is not a regular file")
    if st.st_size > _MAX_BYTES:
        raise ManifestError(f"{f} is {st.st_size} bytes, more than a manifest can be")
    try:
        raw = json.loads(f.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{f} is not valid JSON: {exc}") from None
    return parse_manifest(raw, str(f))


def parse_manifest(raw: Any, where: str = "manifest") -> Manifest:
    """Validates the JSON form of a manifest field by field."""

    def need(obj: Any, name: str, types: type | tuple[type, ...], ctx: str = "") -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise ManifestError(f"{where}: field {ctx}{name!r} is missing")
        value = obj[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise ManifestError(
                f"{where}: field {ctx}{name!r} must be {_names(types)}, not {type(value).__name__}"
            )
        return value

    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if raw.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{where} is not an fsdpcheck manifest (field 'format')")
    version = need(raw, "format_version", int)
    if version > MANIFEST_VERSION or version < 1:
        raise ManifestError(
            f"{where} has format version {version}; this fsdpcheck reads 1 to "
            f"{MANIFEST_VERSION}: upgrade fsdpcheck"
        )
    kind = need(raw, "kind", str)
    if kind not in ("sharded", "full"):
        raise ManifestError(f"{where}: field 'kind' must be 'sharded' or 'full', not {kind!r}")
    world = need(raw, "world_size", int)
    if world < 1:
        raise ManifestError(f"{where}: field 'world_size' must be >= 1, not {world}")
    entries: dict[str, ManifestEntry] = {}
    for key, e in need(raw, "entries", dict).items():
        ctx = f"entries[{key!r}]."
        shape = need(e, "shape", list, ctx)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ManifestError(f"{where}: field {ctx}'shape' must be a list of sizes >= 0")
        fp = e.get("fingerprint") if isinstance(e, dict) else None
        if fp is not None:
            try:
                fp_int = int(fp, 16) if isinstance(fp, str) else None
            except ValueError:
                fp_int = None
            if fp_int is None or not 0 <= fp_int < 1 << 64:
                raise ManifestError(
                    f"{where}: field {ctx}'fingerprint' must be a 64-bit hex "
                    f"string or null, not {fp!r}"
                )
            fp = fp_int
        entries[key] = ManifestEntry(
            need(e, "checkpoint_key", str, ctx), tuple(shape), need(e, "dtype", str, ctx), fp
        )
    tied = raw.get("tied", {})
    if not isinstance(tied, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
    ):
        raise ManifestError(f"{where}: field 'tied' must map names to names")
    return Manifest(
        kind=kind,
        storage=str(raw.get("storage", "dcp")),
        world_size=world,
        entries=entries,
        meshes=[str(m) for m in raw.get("meshes", []) if isinstance(m, str)],
        torch=str(raw.get("torch", "")),
        fsdpcheck=str(raw.get("fsdpcheck", "")),
        created=str(raw.get("created", "")),
        format_version=version,
        tied=dict(tied),
        findings_at_save=[str(x) for x in raw.get("findings_at_save", [])],
    )


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Writes the manifest atomically (readers never see half of one)."""
    p = Path(path)
    tmp = p / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1))
    tmp.replace(p / MANIFEST_NAME)


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(
        {"int": "an integer", "str": "a string", "list": "a list", "dict": "an object"}.get(
            t.__name__, t.__name__
        )
        for t in _tuple(types)
    )
