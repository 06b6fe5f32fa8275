"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``, ``hf://``, any fsspec URL).

NOTE: [object storage] The readers (``DCPSource``, ``SafetensorsSource``) read a batch of
regions as byte ranges of their files; here those ranges come from an object store instead of
``pread``. What changes, and what does not:

- One listing when a checkpoint is opened gives every object's size and identity (ETag,
  generation): the structural checks use those sizes ("shorter than the metadata says" is found
  before anything is read), and every later read names the identity it expects. S3 reads send
  ``If-Match`` and compare the ETag of the answer; other stores compare the identity again
  after a batch. An object replaced meanwhile is "changed while it was read", never mixed in.
- Reads are ranged GETs of exactly the bytes asked for (a chunk's rows, a safetensors header,
  the zip headers of a DCP chunk), streamed into the caller's buffer (the batch arena of the
  read-ahead, under ``memory_budget``), issued concurrently (`CONCURRENCY` in flight per
  process). Nothing is downloaded whole unless the whole object is what is needed.
- Failures are one line naming the object: missing, permission denied, changed, shorter than
  listed, throttled or a server error (`RETRIES` retries with exponential backoff, then an
  error), an endpoint that does not answer (`TIMEOUT` per attempt, a deadline on every wait).
  A read is complete or it raises: never a partial buffer.
- Storage options (endpoint, credentials, region) come from fsspec's configuration
  (``~/.config/fsspec``, ``FSSPEC_<PROTOCOL>_<OPTION>``) and the store library's own (for S3
  boto's ``AWS_*`` variables and ``~/.aws``); none is ever passed on a command line or shown.
- Local paths never come here: they keep their mapped files and ``pread`` (``rawio``).

fsspec and the store's library are optional (``pip install 'fsdpcheck[s3]'``); without them a
URL is refused in one line that says what to install.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpcheck.errors import CheckpointError, ObjectStoreError

__all__ = [
    "CONCURRENCY",
    "RETRIES",
    "TIMEOUT",
    "ObjectFile",
    "ObjectInfo",
    "RemotePath",
    "Store",
    "fetched",
    "fill_from",
    "is_url",
    "location",
    "name_problem",
    "object_size",
    "open_object",
    "read_small",
]


def _env_number(name: str, default: float, cast: Callable[[str], float]) -> float:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = cast(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must not be negative")
    return value


#: Seconds an object store may take to answer one request (environment variable
#: ``FSDPCHECK_REMOTE_TIMEOUT``): a store that says nothing for that long is an error.
TIMEOUT = _env_number("FSDPCHECK_REMOTE_TIMEOUT", 60.0, float)
#: Retries of a request that was throttled, met a server error, timed out or lost its connection
#: (``FSDPCHECK_REMOTE_RETRIES``), with exponential backoff between them.
RETRIES = int(_env_number("FSDPCHECK_REMOTE_RETRIES", 4, int))
#: Requests in flight at once per process (``FSDPCHECK_REMOTE_CONCURRENCY``).
CONCURRENCY = max(1, int(_env_number("FSDPCHECK_REMOTE_CONCURRENCY", 16, int)))
#: Longest pause between two attempts (seconds).
_MAX_BACKOFF = 8.0
#: A listing may take this many times `TIMEOUT` in all (it may be many pages; each request of
#: it is held to `TIMEOUT` by the store's own client).
_LISTING = 10
#: Bytes per piece a ranged answer is copied into the caller's buffer in.
_PIECE = 1 << 20

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: The package that reads each kind of URL (named when it is missing).
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
}
_S3 = ("s3", "s3a")


def url_scheme(x: object) -> str | None:
    """The scheme of a URL string (``s3`` of ``s3://b/k``), or None for anything else."""
    if not isinstance(x, str):
        return None
    m = _URL.match(x)
    return m.group(1).lower() if m else None


def is_url(x: object) -> bool:
    """Whether `x` is a URL read through fsspec (``file://`` is a local path, not one)."""
    scheme = url_scheme(x)
    return scheme is not None and scheme != "file"


def location(x: Any) -> Any:
    """`x` as what readers open: a `RemotePath` for a URL, a Path for ``file://``, else `x`."""
    if isinstance(x, RemotePath):
        return x
    scheme = url_scheme(x)
    if scheme is None:
        return x
    if scheme == "file":
        parsed = urllib.parse.urlparse(x)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{x}: a file:// URL names a file on this machine (file:///path)")
        return Path(urllib.parse.unquote(parsed.path))
    return RemotePath.parse(x)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as a listing showed it: its size and what identifies this version of it.

    Attributes:
        size: Bytes.
        identity: The ETag (S3, Azure), generation (GCS) or what else the store gives, None when
            it gives nothing (then a change is seen only by its size).
        is_dir: A prefix ("directory") rather than an object.
    """

    size: int
    identity: str | None
    is_dir: bool = False


#: What identifies a version of an object, by store (the first present is used).
_IDENTITY_FIELDS = (
    "ETag",
    "etag",
    "generation",
    "version_id",
    "VersionId",
    "md5Hash",
    "blob_id",  # huggingface_hub
    "sha",
    "mtime",
    "LastModified",
    "last_modified",
    "created",
)


def _identity(value: Any) -> str:
    # A time may come as a number from a listing and as a datetime from a lookup of the same
    # object (fsspec's in-memory store does): both become the same seconds.
    if isinstance(value, datetime.datetime):
        value = (
            value.timestamp()
            if value.tzinfo
            else value.replace(tzinfo=datetime.timezone.utc).timestamp()
        )
    return repr(float(value)) if isinstance(value, (int, float)) else str(value)


def _info_of(d: dict[str, Any]) -> ObjectInfo:
    if d.get("type") == "directory":
        return ObjectInfo(0, None, True)
    ident = next((_identity(d[f]) for f in _IDENTITY_FIELDS if d.get(f) not in (None, "")), None)
    size = d.get("size", d.get("Size"))
    return ObjectInfo(int(size) if size is not None else -1, ident)


class RemotePath:
    """An object or prefix in a store, with the path algebra the readers use (``/``, name).

    It is deliberately not ``os.PathLike``: nothing can open it as a local file by mistake.
    """

    __slots__ = ("key", "store")

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key.rstrip("/")

    @classmethod
    def parse(cls, url: str) -> RemotePath:
        """The `RemotePath` of a URL (its store made when first needed).

        Raises:
            ImportError: fsspec, or the library of this kind of URL, is not installed (one line
                saying what to install).
        """
        scheme = url_scheme(url)
        assert scheme is not None
        store = Store.of(scheme, url)
        return cls(store, store.strip(url))

    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __truediv__(self, rel: str) -> RemotePath:
        rel = "/".join(p for p in str(rel).split("/") if p not in ("", "."))
        return RemotePath(self.store, f"{self.key}/{rel}" if rel else self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (other.store, other.key) == (self.store, self.key)

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    def __lt__(self, other: RemotePath) -> bool:
        return self.key < other.key

    @property
    def name(self) -> str:
        """The last component."""
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        """The last ``.suffix`` of the name ("" when none)."""
        name = self.name
        i = name.rfind(".")
        return name[i:] if 0 < i < len(name) - 1 else ""

    @property
    def parent(self) -> RemotePath:
        """The prefix holding it."""
        head = self.key.rsplit("/", 1)[0] if "/" in self.key else self.key
        return RemotePath(self.store, head)

    def relative(self, root: RemotePath) -> str:
        """This path relative to `root` ("." when equal)."""
        if self.key == root.key:
            return "."
        if self.store is root.store and self.key.startswith(root.key + "/"):
            return self.key[len(root.key) + 1 :]
        return str(self)

    # -- what the layout code asks -----------------------------------------------------------
    def info(self) -> ObjectInfo | None:
        """The object or prefix (from a listing that holds it), or None when there is neither."""
        return self.store.info(self.key)

    def listing(self) -> dict[str, ObjectInfo]:
        """Names directly under this prefix (objects and sub-prefixes), listed once."""
        return self.store.listing(self.key)

    def is_dir(self) -> bool:
        """Whether objects exist under this prefix."""
        got = self.info()
        return got is not None and got.is_dir

    def is_file(self) -> bool:
        """Whether this is an object."""
        got = self.info()
        return got is not None and not got.is_dir

    def exists(self) -> bool:
        """Whether this is an object or a prefix with objects."""
        return self.info() is not None


# -- the store ------------------------------------------------------------------------------
_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def _missing_package(scheme: str, url: str, exc: BaseException | None) -> ImportError:
    pkg = _PACKAGES.get(scheme)
    need = f"fsspec and {pkg}" if pkg else "fsspec (and the fsspec implementation of it)"
    extra = "pip install 'fsdpcheck[s3]'" if scheme in _S3 else f"pip install fsspec {pkg or ''}"
    why = f" ({exc})" if exc is not None and pkg is None else ""
    return ImportError(
        f"{url} is a {scheme}:// URL: reading it needs {need}, which are not installed{why}; "
        f"{extra.strip()}"
    )


class Store:
    """One filesystem of fsspec (a protocol), read the way NOTE: [object storage] says.

    Made once per protocol and process (`of`). Its listings are taken when a checkpoint is
    opened and kept (`listing`): sizes and identities are those of that moment.

    Attributes:
        protocol: The URL scheme (``s3``, ``gs``, ...).
        fs: The fsspec filesystem.
        requests / fetched: Ranged reads made and bytes they brought (this process).
    """

    def __init__(self, protocol: str, fs: Any) -> None:
        self.protocol, self.fs = protocol, fs
        self.is_s3 = protocol in _S3
        self.lock = threading.Lock()
        self.listings: dict[str, dict[str, ObjectInfo]] = {}
        self.infos: dict[str, ObjectInfo | None] = {}
        self.requests = 0
        self.fetched = 0
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def of(cls, scheme: str, url: str = "") -> Store:
        """The store of a URL scheme (made, with its filesystem, on first use).

        Raises:
            ImportError: fsspec or the scheme's library is not installed.
        """
        with _STORES_LOCK:
            store = _STORES.get(scheme)
            if store is None:
                store = _STORES[scheme] = cls(scheme, _filesystem(scheme, url))
            return store

    def strip(self, url: str) -> str:
        """The key of a URL in this filesystem (``bkt/ckpt`` of ``s3://bkt/ckpt/``)."""
        return str(self.fs._strip_protocol(url)).rstrip("/")

    def url(self, key: str) -> str:
        """The URL of a key, as users write it."""
        if self.protocol in _S3 or "://" not in str(self.fs.unstrip_protocol(key)):
            return f"{self.protocol}://{key}"
        return str(self.fs.unstrip_protocol(key))

    # -- listings ----------------------------------------------------------------------------
    def listing(self, key: str) -> dict[str, ObjectInfo]:
        """What lies directly under prefix `key`, by name (one listing, kept; {}: nothing).

        Raises:
            PermissionError, ObjectStoreError: as the listing failed.
        """
        with self.lock:
            got = self.listings.get(key)
        if got is not None:
            return got
        out: dict[str, ObjectInfo] = {}
        try:
            found = self._call(key, "listing", lambda: self._ls(key))
        except FileNotFoundError:  # nothing under it (or no such bucket): an empty prefix
            found = []
        for d in found:
            name = str(d.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            if name:
                out[name] = _info_of(d)
        with self.lock:
            self.listings[key] = out
        return out

    def refresh(self, key: str) -> None:
        """Forgets what was listed at and under `key` (a later open lists again)."""
        with self.lock:
            for k in [k for k in self.listings if k == key or k.startswith(key + "/")]:
                del self.listings[k]
            for k in [k for k in self.infos if k == key or k.startswith(key + "/")]:
                del self.infos[k]
        self.refresh_cache(key)

    def info(self, key: str) -> ObjectInfo | None:
        """An object or prefix (from its parent's listing when that was taken), or None."""
        parent, _, name = key.rpartition("/")
        with self.lock:
            listed = self.listings.get(parent)
            if listed is not None and name in listed:
                return listed[name]
            if key in self.infos:
                return self.infos[key]
        try:
            got: ObjectInfo | None = _info_of(self._call(key, "info", lambda: self._info(key)))
        except FileNotFoundError:
            got = None
        if got is not None and got.is_dir is False and got.size < 0:
            got = None
        with self.lock:
            self.infos[key] = got
        return got

    def _ls(self, key: str) -> Any:
        self.refresh_cache(key)
        if self.fs.async_impl:
            return self._sync(self.fs._ls(key, detail=True), _LISTING * self._deadline(0))
        return self.fs.ls(key, detail=True)

    def _info(self, key: str) -> Any:
        self.refresh_cache(key)
        if self.fs.async_impl:
            return self._sync(self.fs._info(key), self._deadline(0))
        return self.fs.info(key)

    def refresh_cache(self, key: str) -> None:
        """Drops fsspec's own cached listing of `key` (fsdpcheck keeps its own, per open)."""
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(key)

    def remove(self, key: str) -> None:
        """Deletes every object under prefix `key` (``fsdpcheck.save(overwrite=True)``)."""
        self._call(key, "removal", lambda: self.fs.rm(key, recursive=True))
        self.refresh(key)

    def write(self, key: str, data: bytes) -> None:
        """Writes one object whole (one PUT: readers see all of it or nothing)."""
        self._call(key, "write", lambda: self.fs.pipe_file(key, data))
        self.refresh(key.rpartition("/")[0])

    # -- reads -------------------------------------------------------------------------------
    def read_into(self, key: str, obj: ObjectInfo, offset: int, view: memoryview) -> None:
        """Fills `view` with bytes ``[offset, offset + len(view))`` of the object.

        Raises:
            FileNotFoundError: The object is gone.
            PermissionError: Reading it is denied.
            ObjectStoreError: It changed, is shorter, or the store failed or did not answer.
        """
        self.read_many([(key, obj, offset, view)])

    def read(self, key: str, obj: ObjectInfo, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset + n)`` of the object (as `read_into`)."""
        buf = bytearray(n)
        self.read_into(key, obj, offset, memoryview(buf))
        return bytes(buf)

    def read_many(self, jobs: Sequence[tuple[str, ObjectInfo, int, memoryview]]) -> None:
        """Fills every job's buffer, `CONCURRENCY` requests in flight at a time.

        Every job is done or an error is raised (the first one, naming its object), after the
        requests in flight have stopped writing.
        """
        jobs = [j for j in jobs if len(j[3])]
        if not jobs:
            return
        for key, obj, offset, view in jobs:
            if obj.size >= 0 and offset + len(view) > obj.size:
                raise ObjectStoreError(
                    f"{self.url(key)} has {obj.size} bytes, fewer than the {offset + len(view)} "
                    "the checkpoint says it holds (it is truncated); refusing to read it"
                )
        if self.fs.async_impl:
            self._sync(self._gather(jobs), None)
        else:
            pool = self._threads()
            futures = [pool.submit(self._attempts, *j) for j in jobs]
            first: BaseException | None = None
            for f in futures:
                try:
                    f.result()
                except BaseException as exc:
                    first = first or exc
            if first is not None:
                raise first
        if not self.is_s3:
            self._same_after(jobs)

    async def _gather(self, jobs: Sequence[tuple[str, ObjectInfo, int, memoryview]]) -> None:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(job: tuple[str, ObjectInfo, int, memoryview]) -> None:
            async with gate:
                await self._attempts_async(*job)

        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed: stop the others before their buffers are reused
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _attempts_async(
        self, key: str, obj: ObjectInfo, offset: int, view: memoryview
    ) -> None:
        t0 = time.monotonic()
        for attempt in range(RETRIES + 1):
            try:
                await asyncio.wait_for(self._get(key, obj, offset, view), self._deadline(len(view)))
                return
            except BaseException as exc:
                failure = _classify(exc)
                if failure is None:
                    raise
                if not failure.retry or attempt == RETRIES:
                    raise self._final(key, failure, attempt + 1, time.monotonic() - t0) from None
            await asyncio.sleep(_backoff(attempt))

    def _attempts(self, key: str, obj: ObjectInfo, offset: int, view: memoryview) -> None:
        """`_attempts_async` for filesystems without an event loop (on a worker thread)."""
        t0 = time.monotonic()
        for attempt in range(RETRIES + 1):
            try:
                self._fill(
                    view, self.fs.cat_file(key, start=offset, end=offset + len(view)), offset
                )
                return
            except BaseException as exc:
                failure = _classify(exc)
                if failure is None:
                    raise
                if not failure.retry or attempt == RETRIES:
                    raise self._final(key, failure, attempt + 1, time.monotonic() - t0) from None
            time.sleep(_backoff(attempt))

    async def _get(self, key: str, obj: ObjectInfo, offset: int, view: memoryview) -> None:
        """One ranged GET into `view` (S3: conditional on the listed ETag; others: cat_file)."""
        n = len(view)
        if not self.is_s3:
            self._fill(view, await self.fs._cat_file(key, start=offset, end=offset + n), offset)
            return
        client = await self.fs.set_session()
        bucket, k, _ = self.fs.split_path(key)
        kw: dict[str, Any] = {
            "Bucket": bucket,
            "Key": k,
            "Range": f"bytes={offset}-{offset + n - 1}",
        }
        if obj.identity and obj.identity.startswith('"'):
            kw["IfMatch"] = obj.identity  # a changed object answers 412, not other bytes
        resp = await client.get_object(**kw)
        async with resp["Body"] as body:
            etag = resp.get("ETag")
            if obj.identity and etag and etag != obj.identity:
                raise _Changed(f"its ETag was {obj.identity} when listed and is {etag} now")
            total = _range_total(resp.get("ContentRange"))
            if total is not None and obj.size >= 0 and total != obj.size:
                raise _Changed(f"it had {obj.size} bytes when listed and has {total} now")
            length = resp.get("ContentLength")
            if isinstance(length, int) and length < n:
                raise _Short(f"asked for {n} bytes at byte {offset}, the store has {length}")
            if isinstance(length, int) and length > n:
                raise _Odd(
                    f"asked for {n} bytes at byte {offset}, the store answered {length} "
                    "(it does not serve byte ranges?)"
                )
            done = 0
            while done < n:
                got = await body.readinto(view[done : min(n, done + _PIECE)])
                if not got:
                    break
                done += got
            self._count(done)
            if done != n:
                raise _Lost(f"the answer ended after {done} of {n} bytes at byte {offset}")

    def _fill(self, view: memoryview, data: bytes, offset: int) -> None:
        self._count(len(data))
        if len(data) != len(view):
            raise _Short(f"only {len(data)} of {len(view)} bytes at byte {offset} could be read")
        view[:] = data

    def _count(self, n: int) -> None:
        with self.lock:
            self.requests += 1
            self.fetched += n

    def _same_after(self, jobs: Sequence[tuple[str, ObjectInfo, int, memoryview]]) -> None:
        """Stores without conditional reads: each object read must still be the listed one."""
        seen: dict[str, ObjectInfo] = {}
        for key, obj, _, _ in jobs:
            seen.setdefault(key, obj)
        for key, obj in seen.items():
            if obj.identity is None:
                continue
            try:
                now = _info_of(self._call(key, "info", lambda k=key: self._info(k)))  # type: ignore[misc]
            except FileNotFoundError:
                raise ObjectStoreError(
                    f"{self.url(key)} changed while it was read: it was deleted; values read "
                    "from it are not reported (run again once nothing writes to it)"
                ) from None
            if now.identity != obj.identity or now.size != obj.size:
                raise ObjectStoreError(
                    f"{self.url(key)} changed while it was read (it was {obj.identity} when "
                    f"listed, {now.identity} after): values read from it are not reported (run "
                    "again once nothing writes to it)"
                )

    # -- plumbing ----------------------------------------------------------------------------
    def _threads(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="fsdpcheck-store")
            return self._pool

    def _deadline(self, n: int) -> float:
        # The store must start answering within TIMEOUT; a long range may then take longer at
        # a slow but steady pace (1 MiB/s at least).
        return TIMEOUT + n / (1 << 20)

    def _sync(self, coro: Any, deadline: float | None) -> Any:
        from fsspec.asyn import sync

        async def bounded() -> Any:
            if deadline is None:
                return await coro
            return await asyncio.wait_for(coro, deadline)

        return sync(self.fs.loop, bounded)

    def _call(self, key: str, what: str, fn: Callable[[], Any]) -> Any:
        """A listing or metadata request, retried as reads are; its failure in one line."""
        t0 = time.monotonic()
        for attempt in range(RETRIES + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except BaseException as exc:
                failure = _classify(exc)
                if failure is None:
                    raise
                if not failure.retry or attempt == RETRIES:
                    raise self._final(
                        key, failure, attempt + 1, time.monotonic() - t0, what
                    ) from None
            time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")

    def endpoint(self) -> str:
        """Where requests go, for messages (the endpoint URL, never a credential)."""
        for attr in ("endpoint_url",):
            v = getattr(self.fs, attr, None)
            if v:
                return str(v)
        client = getattr(self.fs, "_s3", None)
        v = getattr(getattr(client, "meta", None), "endpoint_url", None)
        return str(v) if v else f"the {self.protocol} endpoint"

    def _final(
        self, key: str, f: _Failure, attempts: int, seconds: float, what: str = "read"
    ) -> BaseException:
        url = self.url(key)
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''} over {seconds:.1f} s"
        if f.kind == "missing":
            return FileNotFoundError(
                f"{url} does not exist ({f.detail}): it was removed or never written"
            )
        if f.kind == "denied":
            return PermissionError(
                f"{url}: permission denied ({f.detail}); check the "
                "credentials this process uses for the store"
            )
        if f.kind == "changed":
            return ObjectStoreError(
                f"{url} changed while it was read ({f.detail}): values read "
                "from it are not reported (run again once nothing writes to "
                "it)"
            )
        if f.kind == "short":
            return ObjectStoreError(
                f"{url} is shorter than the checkpoint says ({f.detail}): it was truncated"
            )
        if f.kind == "timeout":
            return ObjectStoreError(
                f"{url}: {self.endpoint()} did not answer the {what} within "
                f"{TIMEOUT:g} s ({tries}); is the endpoint up? "
                "(FSDPCHECK_REMOTE_TIMEOUT sets the deadline)"
            )
        if f.kind == "throttled":
            return ObjectStoreError(
                f"{url}: the store kept refusing the {what} ({f.detail}, "
                f"throttled) after {tries}; try again later, or lower "
                "FSDPCHECK_REMOTE_CONCURRENCY"
            )
        if f.kind == "server":
            return ObjectStoreError(
                f"{url}: the store failed the {what} ({f.detail}) after {tries}"
            )
        if f.kind == "cut":
            return ObjectStoreError(
                f"{url}: the store's answers kept ending before their last byte ({f.detail}) "
                f"after {tries}; nothing read from them is used"
            )
        if f.kind == "connection":
            return ObjectStoreError(
                f"{url}: cannot reach {self.endpoint()} ({f.detail}) after {tries}"
            )
        return ObjectStoreError(f"{url}: the {what} failed: {f.detail}")


@dataclass(frozen=True)
class _Failure:
    kind: str  # missing, denied, changed, short, timeout, throttled, server, cut, connection, other
    detail: str
    retry: bool


class _Changed(Exception):
    pass


class _Short(Exception):
    pass


class _Lost(Exception):
    pass


class _Odd(Exception):
    pass


_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "ProvisionedThroughputExceeded",
    "RequestThrottled",
    "BandwidthLimitExceeded",
}


def _classify(exc: BaseException) -> _Failure | None:
    """What a store's exception means (None: not a store failure; it propagates as it is)."""
    from fsdpcheck.sources.text import one_line

    if isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit)):
        return None
    if isinstance(exc, _Changed):
        return _Failure("changed", str(exc), False)
    if isinstance(exc, _Short):
        return _Failure("short", str(exc), False)
    if isinstance(exc, _Odd):
        return _Failure("other", str(exc), False)
    if isinstance(exc, _Lost) or _named(exc, "ResponseStreaming", "IncompleteRead", "Payload"):
        return _Failure("cut", str(exc) if isinstance(exc, _Lost) else one_line(exc), True)
    # The store library's own error (botocore's ClientError), also behind s3fs's translation.
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            code = str(resp["Error"].get("Code", ""))
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{status} {code}".strip() if status else code
            if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404"):
                return _Failure("missing", detail, False)
            if status == 403 or code in (
                "AccessDenied",
                "Forbidden",
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "403",
            ):
                return _Failure("denied", detail, False)
            if status == 412 or code == "PreconditionFailed":
                return _Failure("changed", f"{detail}: its ETag is not the listed one", False)
            if status == 416 or code == "InvalidRange":
                return _Failure("short", detail, False)
            if status == 429 or code in _THROTTLE_CODES:
                return _Failure("throttled", detail, True)
            if (isinstance(status, int) and status >= 500) or code in (
                "InternalError",
                "ServiceUnavailable",
                "RequestTimeout",
                "503",
                "500",
            ):
                kind = "throttled" if status == 503 else "server"
                return _Failure(kind, detail, True)
            return _Failure("other", f"{detail}: {one_line(exc)}", False)
    if isinstance(exc, FileNotFoundError):
        return _Failure("missing", "not found", False)
    if isinstance(exc, PermissionError):
        return _Failure("denied", one_line(exc), False)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or _named(exc, "Timeout"):
        return _Failure("timeout", type(exc).__name__, True)
    if isinstance(exc, ConnectionError) or _named(
        exc,
        "Connection",
        "Connect",
        "Disconnected",
        "HTTPClientError",
    ):
        return _Failure("connection", one_line(exc), True)
    status = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(status, int) and (status == 429 or 500 <= status < 600):
        return _Failure("throttled" if status in (429, 503) else "server", str(status), True)
    if isinstance(exc, OSError):
        return _Failure("other", one_line(exc), False)
    return None


def _named(exc: BaseException, *words: str) -> bool:
    names = [t.__name__ for t in type(exc).__mro__]
    return any(w in n for n in names for w in words)


def _backoff(attempt: int) -> float:
    return min(_MAX_BACKOFF, 0.1 * 2**attempt)


def _range_total(content_range: Any) -> int | None:
    # "bytes 0-99/1234"
    if not isinstance(content_range, str) or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def _filesystem(scheme: str, url: str) -> Any:
    """Fsspec's filesystem for `scheme`, configured as fsspec's configuration says.

    S3 gets fsdpcheck's deadlines on top of that configuration (what it sets wins): boto's
    connect and read timeouts are `TIMEOUT`, and retries are left to fsdpcheck (`RETRIES`, the
    same for every store), so that one request never takes attempts times retries.
    """
    try:
        import fsspec
        from fsspec.config import conf
    except ImportError as exc:
        raise _missing_package(scheme, url, exc) from None
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        if isinstance(exc, ValueError) and scheme not in _PACKAGES:
            raise ValueError(f"{url}: fsspec knows no {scheme}:// filesystem") from None
        raise _missing_package(scheme, url, exc) from None
    options: dict[str, Any] = {}
    if scheme in _S3:
        config = dict((conf.get("s3") or {}).get("config_kwargs") or {})
        config.setdefault("connect_timeout", TIMEOUT)
        config.setdefault("read_timeout", TIMEOUT)
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    fs = cls(skip_instance_cache=True, **options)
    if scheme in _S3:
        fs.retries = 1  # s3fs's own retry loop: fsdpcheck retries (see the docstring)
    return fs


# -- files over a store -----------------------------------------------------------------------
class ObjectFile:
    """One object read by byte range, as ``rawio`` reads a file descriptor (`pread`).

    Args:
        path: The object.
        info: Its size and identity as listed (reads insist on that version).
    """

    def __init__(self, path: RemotePath, info: ObjectInfo) -> None:
        self.path, self.info = path, info
        self.size = info.size
        self._held: list[tuple[int, bytes]] = []

    def hold(self, offset: int, data: bytes) -> None:
        """Keeps bytes already fetched (a header, a zip's ends): `pread` serves them.

        Once a file holds bytes, what `pread` fetches besides is held too (only the bytes no
        held piece has are fetched): for the short-lived files of one parse.
        """
        self._held.append((offset, data))

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer only past the object's end)."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        if not self._held:
            return self.path.store.read(self.path.key, self.info, offset, n)
        out = bytearray(n)
        view = memoryview(out)
        for lo, hi in fill_from(self._held, offset, view):
            data = self.path.store.read(self.path.key, self.info, lo, hi - lo)
            view[lo - offset : hi - offset] = data
            self._held.append((lo, data))
        return bytes(out)

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fills `view` from `offset` (as `Store.read_into`)."""
        self.path.store.read_into(self.path.key, self.info, offset, view)

    def stream(self, window: int = 8 << 20) -> ObjectStream:
        """The object from its start as a sequential stream (``.metadata``)."""
        return ObjectStream(self, window)


def fill_from(
    held: Sequence[tuple[int, bytes]], start: int, view: memoryview
) -> list[tuple[int, int]]:
    """Copies into `view` (bytes from `start` on) what the held (offset, bytes) pieces have.

    Returns:
        The ranges ``[lo, hi)`` no piece had, in order (to be fetched).
    """
    end = start + len(view)
    spans = sorted(
        (max(at, start), min(at + len(data), end), at, data)
        for at, data in held
        if at < end and at + len(data) > start
    )
    gaps = []
    pos = start
    for lo, hi, at, data in spans:
        if hi <= pos:
            continue
        lo = max(lo, pos)
        if lo > pos:
            gaps.append((pos, lo))
        view[lo - start : hi - start] = memoryview(data)[lo - at : hi - at]
        pos = hi
    if pos < end:
        gaps.append((pos, end))
    return gaps


class ObjectStream:
    """An object read from its start in windows of ranged GETs (``read``, ``seek(0)``)."""

    def __init__(self, f: ObjectFile, window: int) -> None:
        self.f, self.window, self.pos = f, window, 0
        self.size = f.size
        self._buf = b""
        self._at = 0

    def seek(self, pos: int) -> int:
        """Moves to `pos` (the next `read` starts there)."""
        self.pos = pos
        return pos

    def read(self, n: int) -> bytes:
        """Up to `n` bytes (b"" at the end)."""
        if not self._at <= self.pos < self._at + len(self._buf):
            self._at = self.pos
            self._buf = self.f.pread(max(n, self.window), self.pos)
        data = self._buf[self.pos - self._at : self.pos - self._at + n]
        self.pos += len(data)
        return data


def open_object(path: RemotePath, what: str) -> ObjectFile:
    """An object to read by byte range, as listed now.

    Raises:
        FileNotFoundError: It does not exist.
        CheckpointError: It is a prefix (a folder), not an object.
    """
    info = path.info()
    if info is None:
        raise FileNotFoundError(f"{what} {path} does not exist")
    if info.is_dir:
        raise CheckpointError(
            f"{what} {path} is a prefix (a folder), not an object; refusing to read it"
        )
    return ObjectFile(path, info)


def name_problem(rel: str) -> str | None:
    """Why a name a checkpoint gives for one of its files may not be read under its prefix.

    The rules of ``fileio.relative_path_problem`` (no absolute name, no ``..``): an object store
    has no links, so nothing else can lead outside.
    """
    if "\x00" in rel:
        return f"names {rel!r}, which holds a NUL byte (no file can)"
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts:
        return f"names {rel!r}, which is not a file"
    if rel.startswith(("/", "\\")) or ":" in parts[0]:
        return f"names the absolute path {rel!r}"
    if ".." in parts or "\\" in rel:
        return f"names {rel!r}, outside the checkpoint directory"
    return None


def object_size(root: RemotePath, rel: str, what: str) -> tuple[str | None, int]:
    """(why `rel` under `root` cannot be read at all, or None; its size from the listing)."""
    bad = name_problem(rel)
    if bad is not None:
        return f"{what} {bad}", 0
    info = (root / rel).info()
    if info is None:
        return f"{what}: data file {root / rel} does not exist", 0
    if info.is_dir:
        return f"{what}: data file {root / rel} is a prefix (a folder), not an object", 0
    return None, info.size


def read_small(path: RemotePath, limit: int, what: str) -> bytes:
    """A whole small object (an index, a manifest), refused before the fetch beyond `limit`.

    Raises:
        FileNotFoundError: It does not exist.
        CheckpointError: It is larger than `limit` or a prefix, not an object.
    """
    f = open_object(path, what)
    if f.size > limit:
        raise CheckpointError(
            f"{what} {path} has {f.size} bytes, more than the {limit} fsdpcheck reads; refusing it"
        )
    return f.pread(f.size, 0)


def fetched() -> dict[str, int]:
    """Ranged reads made and bytes fetched by this process, over every store (for benches)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
    return {
        "requests": sum(s.requests for s in stores),
        "bytes": sum(s.fetched for s in stores),
    }


def reset_fetched() -> None:
    """Zeroes `fetched`."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
    for s in stores:
        with s.lock:
            s.requests = s.fetched = 0
