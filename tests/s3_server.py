"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1, and a proxy.

``MotoServer`` starts ``moto_server -H 127.0.0.1 -p PORT`` (from ``moto[server]``, in the venv)
on a free port and stops it by its pid. ``Proxy`` sits in front of it on one port per client
(the ranks of a multi-rank test each get their own, so what each rank fetched is told apart):
it forwards every request, logs what was asked and how many bytes went back (the request log
the byte-count tests read), and can be told to misbehave for the failure tests: answer an error
(throttling, a server error, permission denied), never answer (a stalled endpoint), or run a
function first (replace an object while it is being read).

A client reads its own port's log with ``GET /__fsdpcheck__/log`` (the entries since its last
call; not forwarded, not logged).
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKET = "fsdpcheck-tests"
#: What every client of the server is given (moto accepts any credentials).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
LOG_PATH = "/__fsdpcheck__/log"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, proc: subprocess.Popen[bytes] | None, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode} before it answered")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing answered on 127.0.0.1:{port} within {timeout} s")


class MotoServer:
    """moto's S3 server on 127.0.0.1 (started here, stopped by pid)."""

    def __init__(self, log: Path) -> None:
        exe = Path(sys.executable).parent / "moto_server"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} is missing: install moto[server] (scripts/setup.sh)")
        self.port = free_port()
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait_for(self.port, self.proc)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@dataclass
class Rule:
    """What the proxy does instead of (or before) forwarding a matching request."""

    method: str | None  # None: any
    contains: str  # in the request path
    action: str  # "status", "stall" or "call"
    status: int = 503
    code: str = "SlowDown"
    times: int | None = None  # None: every time
    fn: Callable[[], None] | None = None
    ranged: bool = False  # only requests with a Range header
    hits: int = 0

    def matches(self, method: str, path: str, headers: Any) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.ranged and "Range" not in headers:
            return False
        return self.contains in path and (self.times is None or self.hits < self.times)


@dataclass
class Entry:
    tag: int
    method: str
    path: str
    range: str | None
    status: int
    nbytes: int


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # a client that left is not news


@dataclass
class Proxy:
    """An HTTP proxy in front of moto, one listening port per tag (see the module docstring)."""

    upstream: int
    tags: int = 1
    rules: list[Rule] = field(default_factory=list)
    log: list[Entry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.inflight = 0  # requests being answered now, and the most at once since clear()
        self.most = 0
        self.servers: list[http.server.ThreadingHTTPServer] = []
        for tag in range(self.tags):
            server = _Server(("127.0.0.1", 0), _handler(self, tag))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
        self.ports = [s.server_address[1] for s in self.servers]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]

    # -- faults --------------------------------------------------------------------------------
    def fail(
        self,
        contains: str,
        status: int = 503,
        code: str = "SlowDown",
        *,
        times: int | None = None,
        method: str | None = "GET",
    ) -> Rule:
        return self._add(Rule(method, contains, "status", status, code, times))

    def stall(self, contains: str, *, method: str | None = None, ranged: bool = False) -> Rule:
        return self._add(Rule(method, contains, "stall", ranged=ranged))

    def cut(self, contains: str, *, times: int | None = None) -> Rule:
        """Ranged GETs answered with half their body, then the connection closed."""
        return self._add(Rule("GET", contains, "cut", times=times, ranged=True))

    def before(self, contains: str, fn: Callable[[], None], *, times: int = 1) -> Rule:
        return self._add(Rule("GET", contains, "call", times=times, fn=fn, ranged=True))

    def _add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """No faults, an empty log, and stalled requests let go."""
        with self.lock:
            self.rules.clear()
            self.log.clear()
            self.most = 0
        self.release.set()
        self.release = threading.Event()

    def entries(self, tag: int | None = None, contains: str = "") -> list[Entry]:
        with self.lock:
            return [e for e in self.log if (tag is None or e.tag == tag) and contains in e.path]

    def close(self) -> None:
        self.release.set()
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _handler(proxy: Proxy, tag: int) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _reply(
            self,
            status: int,
            headers: list[tuple[str, str]],
            body: bytes,
            length: str | None = None,
        ) -> None:
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", length if length is not None else str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _any(self) -> None:
            body = self._body()
            if self.path.startswith(LOG_PATH):
                with proxy.lock:
                    mine = [e.__dict__ for e in proxy.log if e.tag == tag]
                    proxy.log[:] = [e for e in proxy.log if e.tag != tag]
                self._reply(200, [("Content-Type", "application/json")], json.dumps(mine).encode())
                return
            rule = None
            with proxy.lock:
                for r in proxy.rules:
                    if r.matches(self.command, self.path, self.headers):
                        r.hits += 1
                        rule = r
                        break
                release = proxy.release
            rng = self.headers.get("Range")
            if rule is not None and rule.action == "stall":
                release.wait(600)  # say nothing until the test lets go
                self.close_connection = True
                return
            if rule is not None and rule.action == "status":
                xml = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                    f"<Message>fault planted by the test proxy</Message></Error>"
                ).encode()
                with proxy.lock:
                    proxy.log.append(Entry(tag, self.command, self.path, rng, rule.status, 0))
                self._reply(rule.status, [("Content-Type", "application/xml")], xml)
                return
            if rule is not None and rule.action == "call" and rule.fn is not None:
                rule.fn()
            with proxy.lock:
                proxy.inflight += 1
                proxy.most = max(proxy.most, proxy.inflight)
            try:
                self._forward(body, rule, rng)
            finally:
                with proxy.lock:
                    proxy.inflight -= 1

        def _forward(self, body: bytes, rule: Rule | None, rng: str | None) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=120)
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in ("transfer-encoding", "connection", "content-length")
            }
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            cut = rule is not None and rule.action == "cut"
            sent = len(data) // 2 if cut else len(data)
            with proxy.lock:
                proxy.log.append(Entry(tag, self.command, self.path, rng, resp.status, sent))
            if cut:
                # The headers promise every byte; half come, then the connection closes.
                self._reply(resp.status, resp.getheaders(), data[:sent], str(len(data)))
                self.close_connection = True
                return
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            self._reply(resp.status, resp.getheaders(), data, length)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

    return Handler


def own_log(endpoint: str) -> list[dict[str, Any]]:
    """The proxy's log of this client's port since its last call (from inside a rank)."""
    host, port = endpoint.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", LOG_PATH)
    data = conn.getresponse().read()
    conn.close()
    return json.loads(data)


def object_key(path: str) -> str:
    """The object a logged request asked for (``bucket/key``, without the query)."""
    return path.split("?", 1)[0].lstrip("/")
