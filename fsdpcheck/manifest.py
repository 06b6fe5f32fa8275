"""The fsdpcheck manifest (``fsdpcheck_manifest.json``): typed, validated before any use.

Written by ``fsdpcheck.save`` next to a DCP checkpoint; holds per key its Fingerprint v1,
global shape, dtype and checkpoint key, and which DCP save it was written for (the save id DCP
writes into ``.metadata`` at every save, and a hash of that file), so that a manifest left behind
by an earlier save is told apart from a damaged checkpoint. A manifest is data from a file
someone else may have written: it is parsed as JSON only, and every field is checked (one line
naming the field) before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpcheck.errors import ManifestError as ManifestError

MANIFEST_NAME = "fsdpcheck_manifest.json"
MANIFEST_FORMAT = "fsdpcheck-manifest"
MANIFEST_VERSION = 1
_MAX_BYTES = 256 << 20  # a manifest of a 10**6-tensor checkpoint is ~200 MB; refuse beyond
# Leftovers of a manifest write that was killed before its rename (cleaned by the next write).
_TMP_PREFIX = f".{MANIFEST_NAME}.tmp-"


@dataclass(frozen=True)
class ManifestEntry:
    """One tensor of the manifest."""

    checkpoint_key: str
    shape: tuple[int, ...]
    dtype: str
    fingerprint: int | None


@dataclass(frozen=True)
class SaveIdentity:
    """Which DCP save a manifest was written for.

    Attributes:
        save_id: The id DCP writes into ``.metadata`` at every save (a new one each time).
        metadata_sha256: The SHA-256 of that ``.metadata`` (unchanged: no need to read it).
    """

    save_id: str
    metadata_sha256: str


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
    #: The DCP save(s) it was written for, by directory relative to the manifest's folder
    #: ("." for the folder itself). Empty in manifests written before fsdpcheck recorded them
    #: (or by torch without save ids): those cannot be told stale.
    saves: dict[str, SaveIdentity] = field(default_factory=dict)

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
            "dcp_saves": {
                k: {"save_id": v.save_id, "metadata_sha256": v.metadata_sha256}
                for k, v in sorted(self.saves.items())
            },
        }

    def fingerprints(self) -> dict[str, int]:
        """Key -> fingerprint, for the entries that have one."""
        return {k: e.fingerprint for k, e in self.entries.items() if e.fingerprint is not None}


def read_manifest(path: Any) -> Manifest | None:
    """The manifest of a checkpoint directory (or prefix in an object store), or None.

    Raises:
        ManifestError: The manifest exists but is not a valid fsdpcheck manifest.
    """
    f: Any
    try:
        if isinstance(path, (str, os.PathLike)):
            f = Path(path) / MANIFEST_NAME
            data = _read_regular(f, _MAX_BYTES)
        else:  # in an object store (sources.remote.RemotePath): the same limit, before the fetch
            from fsdpcheck.sources.remote import read_small

            f = path / MANIFEST_NAME
            data = read_small(f, _MAX_BYTES, "manifest")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{f}: {exc}") from None
    try:
        return parse_manifest(json.loads(data), str(f))
    except RecursionError:
        # Python's JSON parser recurses once per level: a deeply nested file exhausts the
        # stack long before its size limit; no manifest nests more than four levels.
        raise ManifestError(f"{f} is nested deeper than any manifest (not a manifest)") from None
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{f} is not valid JSON: {exc}") from None


def _read_regular(f: Path, limit: int) -> bytes:
    """A regular file's bytes (at most `limit`), checked on the descriptor that reads them.

    O_NONBLOCK: opening a FIFO put in the file's place does not wait for a writer; fstat on
    the open descriptor then refuses it (and devices, sockets), whatever the path held before.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a regular file, or larger than `limit`.
    """
    fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than a manifest can be")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(limit + 1 - size, 1 << 24))):
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew while read
            raise ValueError(f"more than {limit} bytes, more than a manifest can be")
        return b"".join(chunks)
    finally:
        os.close(fd)


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a regular file, read on one descriptor checked with fstat."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


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
                shown = repr(fp) if isinstance(fp, (str, int, float)) else type(fp).__name__
                raise ManifestError(
                    f"{where}: field {ctx}'fingerprint' must be a 64-bit hex "
                    f"string or null, not {shown[:80]}"
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
    findings = raw.get("findings_at_save", [])
    if not isinstance(findings, list) or not all(isinstance(x, str) for x in findings):
        raise ManifestError(f"{where}: field 'findings_at_save' must be a list of strings")
    saves = {}
    for rel, ident in need(raw, "dcp_saves", dict).items() if "dcp_saves" in raw else ():
        ctx = f"dcp_saves[{rel!r}]."
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ManifestError(f"{where}: field 'dcp_saves' names {rel!r}, outside the folder")
        digest = need(ident, "metadata_sha256", str, ctx)
        if len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise ManifestError(f"{where}: field {ctx}'metadata_sha256' must be a SHA-256")
        saves[rel] = SaveIdentity(need(ident, "save_id", str, ctx), digest)
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
        findings_at_save=list(findings),
        saves=saves,
    )


def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Writes the manifest atomically: readers see the old one or the new one, whole.

    The JSON goes into a new hidden file of its own (``O_EXCL | O_NOFOLLOW``: never through a
    link someone left there), is flushed to disk, and replaces the manifest with one rename;
    leftovers of a write killed before its rename are removed here.
    """
    p = Path(path)
    for stale in p.glob(f"{_TMP_PREFIX}*"):
        stale.unlink(missing_ok=True)
    tmp = p / f"{_TMP_PREFIX}{secrets.token_hex(6)}"
    data = json.dumps(manifest.to_json(), indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p / MANIFEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flushes a directory's entries (a rename in it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: nothing more to do
        pass
    finally:
        os.close(fd)


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(
        {"int": "an integer", "str": "a string", "list": "a list", "dict": "an object"}.get(
            t.__name__, t.__name__
        )
        for t in _tuple(types)
    )
