"""Checkpoints in object storage, against a real S3-compatible server (moto's, on 127.0.0.1).

The checkpoints are written by the real writers at test time: DCP's FsspecWriter straight into
the server, and safetensors shards with their index (huggingface_hub's own sharding) uploaded
with s3fs. Every read goes through the test proxy (tests/s3_server.py), whose log shows what
was fetched; the failure tests make the proxy misbehave. The multi-rank tests (verify of an
FSDP2 model, bytes per rank) are in test_s3_dist.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck.cli import main
from fsdpcheck.errors import CheckpointError, ObjectStoreError
from fsdpcheck.inspection import inspect_checkpoint
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources import remote as R
from fsdpcheck.sources.base import Region
from tests import REPO_ROOT

pytest.importorskip("s3fs", reason="s3fs is not installed (scripts/setup.sh)")
REPO = REPO_ROOT


def state() -> dict[str, Any]:
    """A state dict of several dtypes and shapes: 0-d, empty, a transposed view, bf16, int."""
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            "emb.weight": torch.randn(300, 64, generator=g),
            "big.weight": torch.randn(2048, 48, generator=g).to(torch.bfloat16),
            "head.bias": torch.randn(7, generator=g),
            "proj.weight": torch.randn(20, 30, generator=g).t(),  # saved with its strides
            "scale": torch.tensor(0.5),
            "steps": torch.arange(3, dtype=torch.int64),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"lr": 0.25},
    }


class S3:
    """One test's corner of the server: a unique prefix, the direct client, the proxy."""

    def __init__(self, server: Any, proxy: Any, name: str) -> None:
        import fsspec

        from tests.s3_server import BUCKET

        self.server, self.proxy = server, proxy
        self.prefix = f"{BUCKET}/{name}-{uuid.uuid4().hex[:6]}"
        # Writes go straight to moto (not through the proxy, whose log is for reads).
        self.fs = fsspec.filesystem("s3", endpoint_url=server.url, skip_instance_cache=True)

    def url(self, name: str) -> str:
        return f"s3://{self.prefix}/{name}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def dcp(self, name: str, sd: dict[str, Any]) -> str:
        """`sd` saved by DCP's FsspecWriter into the server."""
        import torch.distributed.checkpoint as dcp

        from fsdpcheck._compat import fsspec_writer

        # Straight to moto (the proxy's log is for reads).
        writer = fsspec_writer(self.url(name), endpoint_url=self.server.url)
        dcp.save(sd, storage_writer=writer, no_dist=True)
        return self.url(name)

    def put(self, local: Path, name: str) -> str:
        self.fs.put(str(local), self.key(name), recursive=local.is_dir())
        return self.url(name)

    def gets(self, name: str = "") -> list[Any]:
        """The proxy's log of GETs for objects of this test (optionally one object)."""
        return [e for e in self.proxy.entries(0, self.key(name)) if e.method == "GET"]


@pytest.fixture
def s3(s3_server, request, monkeypatch):
    server, proxy = s3_server
    proxy.clear()
    # A fresh store per test, with short deadlines and few retries (read when it is made).
    monkeypatch.setattr(R, "_STORES", {})
    monkeypatch.setattr(R, "TIMEOUT", 20.0)
    monkeypatch.setattr(R, "RETRIES", 2)
    monkeypatch.setattr(R, "_MAX_BACKOFF", 0.2)
    yield S3(server, proxy, request.node.name.split("[")[0][5:40])
    proxy.clear()


def local_dcp(tmp_path: Path, sd: dict[str, Any], name: str = "local") -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=str(tmp_path / name), no_dist=True)
    return tmp_path / name


def without_paths(info: dict[str, Any]) -> dict[str, Any]:
    out = dict(info)
    for k in ("path", "format"):
        out.pop(k)
    return out


def attempts(gets: list[Any]) -> dict[str, int]:
    """How many times each byte range was asked for."""
    out: dict[str, int] = {}
    for e in gets:
        out[e.range] = out.get(e.range, 0) + 1
    return out


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


# -- DCP ------------------------------------------------------------------------------------------
def test_dcp_written_by_fsspec_writer(s3, tmp_path):
    sd = state()
    url = s3.dcp("ckpt", sd)
    local = local_dcp(tmp_path, sd)
    assert without_paths(inspect_checkpoint(url)) == without_paths(inspect_checkpoint(local))
    report = fsdpcheck.audit(url, deep=True)
    assert report.ok and report.keys_checked == 7, str(report)
    r = fsdpcheck.compare_checkpoints(url, local)
    assert r.ok and r.keys_checked == 7, str(r)
    assert fsdpcheck.fingerprint_checkpoint(url) == fsdpcheck.fingerprint_checkpoint(local)
    # Every GET was a byte range: nothing was downloaded whole.
    gets = s3.gets("ckpt/")
    assert gets and all(e.range is not None and e.status == 206 for e in gets), gets
    assert main(["inspect", url]) == 0
    assert main(["compare", url, str(local)]) == 0


def test_compare_names_a_planted_element(s3, tmp_path):
    sd = state()
    url = s3.dcp("ckpt", sd)
    sd["model"]["emb.weight"][123, 45] += 1
    planted = local_dcp(tmp_path, sd, "planted")
    r = fsdpcheck.compare_checkpoints(url, planted)
    assert not r.ok
    (f,) = r.findings
    assert (f.key, f.kind, f.mismatched, f.max_abs_index) == ("emb.weight", "value", 1, (123, 45))
    assert main(["compare", url, str(planted)]) == 1


def test_dcp_region_fetches_only_its_rows(s3):
    sd = state()
    url = s3.dcp("ckpt", sd)
    src = open_source(url)
    try:
        s3.proxy.clear()
        (got,) = src.read([Region("model.emb.weight", (100, 0), (50, 64))], torch.device("cpu"))
        assert torch.equal(got, sd["model"]["emb.weight"][100:150])
    finally:
        src.close()
    data = [e for e in s3.gets("ckpt/__0_0.distcp")]
    spans = [tuple(int(x) for x in e.range.split("=")[1].split("-")) for e in data]
    # The chunk's zip records (its two ends, 4 KiB each), then exactly the 50 rows.
    rows = [s for s in spans if s[1] - s[0] + 1 == 50 * 64 * 4]
    assert len(rows) == 1 and len(spans) == 3, spans
    assert all(b - a + 1 <= 4096 for a, b in spans if (a, b) != rows[0])
    assert sum(e.nbytes for e in data) == 50 * 64 * 4 + 2 * 4096


# -- safetensors ----------------------------------------------------------------------------------
def test_safetensors_index_uploaded_with_s3fs(s3, tmp_path):
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in state()["model"].items()}
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(sd, tmp_path / "hf", max_shard_size="60KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    save_file(sd, str(tmp_path / "one.safetensors"))
    folder = s3.put(tmp_path / "hf", "hf")
    one = s3.put(tmp_path / "one.safetensors", "one.safetensors")
    index = f"{folder}/model.safetensors.index.json"
    expected = fsdpcheck.fingerprint_checkpoint(tmp_path / "hf")
    for url in (folder, index, one):
        assert fsdpcheck.fingerprint_checkpoint(url) == expected, url
        assert fsdpcheck.audit(url, deep=True).ok, url
        assert (
            without_paths(inspect_checkpoint(url))["tensors"]
            == without_paths(inspect_checkpoint(tmp_path / "hf"))["tensors"]
        )
    r = fsdpcheck.compare_checkpoints(index, tmp_path / "one.safetensors")
    assert r.ok and r.keys_checked == 7, str(r)
    assert all(e.range is not None for e in s3.gets())
    # A shard the index names is gone: named, as a local one would be.
    shard = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))[0]
    s3.fs.rm(s3.key(f"hf/{shard}"))
    r = fsdpcheck.audit(index)
    assert not r.ok and all(f"{folder}/{shard} does not exist" in f.message for f in r.findings)
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.fingerprint_checkpoint(index)
    assert shard in one_line(e.value)


def test_safetensors_region_fetches_only_its_rows(s3, tmp_path):
    from safetensors.torch import save_file

    big = torch.randn(1000, 256)
    save_file({"a": torch.randn(3), "big": big}, str(tmp_path / "m.safetensors"))
    url = s3.put(tmp_path / "m.safetensors", "m.safetensors")
    src = open_source(url)
    try:
        s3.proxy.clear()
        (got,) = src.read([Region("big", (600, 0), (100, 256))], torch.device("cpu"))
        assert torch.equal(got, big[600:700])
    finally:
        src.close()
    (e,) = s3.gets("m.safetensors")
    assert e.nbytes == 100 * 256 * 4


def test_a_header_claiming_8_gb_is_refused_before_it_is_fetched(s3, tmp_path):
    f = tmp_path / "huge.safetensors"
    f.write_bytes((8 << 30).to_bytes(8, "little") + b"{" + b" " * 200_000 + b"}")
    url = s3.put(f, "huge.safetensors")
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    assert "huge.safetensors" in one_line(e.value) and "header" in str(e.value)
    assert sum(x.nbytes for x in s3.gets()) <= 64 << 10


def test_metadata_over_the_limit_is_refused_before_it_is_fetched(s3, monkeypatch):
    from fsdpcheck.sources.dcp import index as dcp_index

    url = s3.dcp("ckpt", state())
    monkeypatch.setattr(dcp_index, "MAX_METADATA", 100)
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    assert ".metadata has" in one_line(e.value) and "more than the 100" in str(e.value)
    assert not s3.gets(".metadata")


# -- what object storage does wrong ---------------------------------------------------------------
def test_truncated_object_found_from_the_listing(s3):
    url = s3.dcp("ckpt", state())
    data = s3.fs.cat_file(s3.key("ckpt/__0_0.distcp"))
    s3.fs.pipe_file(s3.key("ckpt/__0_0.distcp"), data[: len(data) // 2])
    r = fsdpcheck.audit(url)
    assert not r.ok
    assert all("__0_0.distcp" in f.message and "truncated" in f.message for f in r.findings)
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    assert "__0_0.distcp" in one_line(e.value) and "truncated" in str(e.value)
    assert not s3.gets("ckpt/__0_0.distcp")  # refused from its listed size: nothing fetched


def test_missing_object(s3):
    url = s3.dcp("ckpt", state())
    s3.fs.rm(s3.key("ckpt/__0_0.distcp"))
    r = fsdpcheck.audit(url)
    assert not r.ok and f"{url}/__0_0.distcp does not exist" in r.findings[0].message
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    assert f"{url}/__0_0.distcp does not exist" in one_line(e.value)
    with pytest.raises(FileNotFoundError) as e2:
        inspect_checkpoint(url + "-nothing-here")
    assert "does not exist" in one_line(e2.value)


def test_object_replaced_while_it_is_read(s3):
    url = s3.dcp("ckpt", state())
    key = s3.key("ckpt/__0_0.distcp")
    data = bytearray(s3.fs.cat_file(key))
    data[-100] ^= 1  # the same size: only its identity tells

    # Replaced right after the checkpoint was opened (listed), as the first byte range of it
    # is asked for.
    s3.proxy.before("ckpt/__0_0.distcp", lambda: s3.fs.pipe_file(key, bytes(data)))
    with pytest.raises(ObjectStoreError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    text = one_line(e.value)
    assert f"{url}/__0_0.distcp changed while it was read" in text, text


def test_throttled_then_answered(s3, tmp_path):
    sd = state()
    url = s3.dcp("ckpt", sd)
    s3.proxy.fail("ckpt/__0_0.distcp", 503, "SlowDown", times=2)
    assert fsdpcheck.fingerprint_checkpoint(url) == fsdpcheck.fingerprint_checkpoint(
        local_dcp(tmp_path, sd)
    )
    assert [e.status for e in s3.gets("ckpt/__0_0.distcp")][:2] == [503, 503]


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [(503, "SlowDown", "throttled"), (500, "InternalError", "500 InternalError")],
)
def test_throttled_or_failing_for_good(s3, status, code, words):
    url = s3.dcp("ckpt", state())
    s3.proxy.fail("ckpt/__0_0.distcp", status, code)
    with pytest.raises(ObjectStoreError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    text = one_line(e.value)
    assert f"{url}/__0_0.distcp" in text and words in text and "3 attempts" in text, text
    # RETRIES (2) retries of each request in flight, then the error: bounded.
    tries = attempts(s3.gets("ckpt/__0_0.distcp"))
    assert max(tries.values()) == 3 and all(n <= 3 for n in tries.values()), tries


def test_permission_denied(s3):
    url = s3.dcp("ckpt", state())
    s3.proxy.fail("ckpt/__0_0.distcp", 403, "AccessDenied")
    with pytest.raises(PermissionError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    text = one_line(e.value)
    assert f"{url}/__0_0.distcp: permission denied (403 AccessDenied)" in text, text
    assert set(attempts(s3.gets("ckpt/__0_0.distcp")).values()) == {1}  # never retried


def test_an_answer_cut_short_is_never_used(s3, tmp_path):
    """A body that ends before the bytes its headers promise: asked again, or an error."""
    sd = state()
    url = s3.dcp("ckpt", sd)
    s3.proxy.cut("ckpt/__0_0.distcp", times=1)
    assert fsdpcheck.fingerprint_checkpoint(url) == fsdpcheck.fingerprint_checkpoint(
        local_dcp(tmp_path, sd)
    )
    s3.proxy.clear()
    s3.proxy.cut("ckpt/__0_0.distcp")
    with pytest.raises(ObjectStoreError) as e:
        fsdpcheck.fingerprint_checkpoint(url)
    text = one_line(e.value)
    assert f"{url}/__0_0.distcp" in text and "ending before their last byte" in text, text
    assert "3 attempts" in text, text


def test_requests_in_flight_are_bounded(s3, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    save_file({f"t{i}": torch.randn(64, 64) for i in range(40)}, str(tmp_path / "m.safetensors"))
    url = s3.put(tmp_path / "m.safetensors", "m.safetensors")
    monkeypatch.setattr(R, "CONCURRENCY", 3)
    s3.proxy.clear()
    fsdpcheck.fingerprint_checkpoint(url)
    assert len(s3.gets("m.safetensors")) == 41  # the header, then one range per tensor
    assert 2 <= s3.proxy.most <= 3, s3.proxy.most  # concurrent, and never more than allowed


def test_reads_land_in_the_callers_buffers(s3, tmp_path):
    """A batch is read into the buffers it is given (the read-ahead's reused arena)."""
    from safetensors.torch import save_file

    sd = state()
    url = s3.dcp("ckpt", sd)
    save_file({"w": sd["model"]["emb.weight"]}, str(tmp_path / "w.safetensors"))
    st = s3.put(tmp_path / "w.safetensors", "w.safetensors")
    for ref, key in ((url, "model.emb.weight"), (st, "w")):
        src = open_source(ref)
        try:
            out = [torch.empty(40, 64), torch.empty(60, 64)]
            regions = [Region(key, (0, 0), (40, 64)), Region(key, (200, 0), (60, 64))]
            got = src.read_views(regions, out)
            assert [g.data_ptr() for g in got] == [o.data_ptr() for o in out]
            assert torch.equal(out[1], sd["model"]["emb.weight"][200:260])
        finally:
            src.close()


def test_columns_through_bounded_scratch(s3, monkeypatch):
    """Parts that need scratch buffers (some columns of the rows) are read in bounded waves."""
    from fsdpcheck.sources.dcp import remote as remote_dcp

    sd = state()
    url = s3.dcp("ckpt", sd)
    monkeypatch.setattr(remote_dcp, "_SCRATCH", 1)  # a wave per part
    src = open_source(url)
    try:
        regions = [
            Region("model.emb.weight", (7, 10), (200, 11)),
            Region("model.big.weight", (1000, 40), (48, 8)),
            Region("model.proj.weight", (3, 2), (20, 5)),  # saved transposed: read whole
            Region("model.head.bias", (2,), (4,)),
        ]
        got = src.read(regions, torch.device("cpu"))
        ref = sd["model"]
        assert torch.equal(got[0], ref["emb.weight"][7:207, 10:21])
        assert torch.equal(got[1], ref["big.weight"][1000:1048, 40:48])
        assert torch.equal(got[2], ref["proj.weight"][3:23, 2:7])
        assert torch.equal(got[3], ref["head.bias"][2:6])
    finally:
        src.close()


def test_storage_options_from_fsspec_configuration(s3, tmp_path):
    """The endpoint from fsspec's own configuration (FSSPEC_S3_ENDPOINT_URL), not boto's."""
    sd = state()
    url = s3.dcp("ckpt", sd)
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env["FSSPEC_S3_ENDPOINT_URL"] = s3.proxy.urls[0]
    p = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "fingerprint", url, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    expected = fsdpcheck.fingerprint_checkpoint(local_dcp(tmp_path, sd))
    assert json.loads(p.stdout) == {k: f"{v:#018x}" for k, v in expected.items()}


def test_stalled_endpoint_meets_its_deadline(s3, capsys, monkeypatch):
    url = s3.dcp("ckpt", state())
    monkeypatch.setattr(R, "TIMEOUT", 1.0)
    monkeypatch.setattr(R, "RETRIES", 1)
    s3.proxy.stall("ckpt/__0_0.distcp", ranged=True)
    capsys.readouterr()
    assert main(["fingerprint", url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"{url}/__0_0.distcp" in err and "did not answer" in err and "within 1 s" in err, err


def test_stalled_listing_from_the_command_line(s3, tmp_path):
    """A whole run against an endpoint that never answers: one line, a bounded time."""
    url = s3.dcp("ckpt", state())
    s3.proxy.stall("ckpt")
    env = {
        **os.environ,
        "FSDPCHECK_REMOTE_TIMEOUT": "1",
        "FSDPCHECK_REMOTE_RETRIES": "1",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-never-shown",
    }
    p = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "inspect", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip()
    assert err.count("\n") == 0 and "did not answer" in err and url in err, err
    assert "s3cr3t" not in p.stderr + p.stdout


def test_without_fsspec_a_url_says_what_to_install(tmp_path):
    blocked = "import sys; sys.modules['fsspec'] = None; sys.modules['s3fs'] = None; "
    code = blocked + "from fsdpcheck.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run(
        [sys.executable, "-c", code, "inspect", "s3://bucket/ckpt"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 2
    err = p.stderr.strip()
    assert err.count("\n") == 0 and "pip install 'fsdpcheck[s3]'" in err, err
    # Local paths never need it.
    sd = {"w": torch.arange(6.0)}
    torch.save(sd, tmp_path / "w.pt")
    p = subprocess.run(
        [sys.executable, "-c", code, "fingerprint", str(tmp_path / "w.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr


def test_file_urls_are_local_paths(tmp_path):
    local = local_dcp(tmp_path, state())
    assert fsdpcheck.fingerprint_checkpoint(f"file://{local}") == (
        fsdpcheck.fingerprint_checkpoint(local)
    )
    assert main(["inspect", f"file://{local}"]) == 0


def test_any_fsspec_filesystem(tmp_path):
    """A store without conditional reads (fsspec's in-memory one): the generic path."""
    import fsspec
    import torch.distributed.checkpoint as dcp

    from fsdpcheck._compat import fsspec_writer

    sd = state()
    url = f"memory://fsdpcheck-{uuid.uuid4().hex[:6]}/ckpt"
    dcp.save(sd, storage_writer=fsspec_writer(url), no_dist=True)
    local = local_dcp(tmp_path, sd)
    fs = fsspec.filesystem("memory")
    try:
        assert fsdpcheck.compare_checkpoints(url, local).ok
        assert fsdpcheck.fingerprint_checkpoint(url) == fsdpcheck.fingerprint_checkpoint(local)
        # An object changed after the listing: seen after the read, never reported as read.
        src = open_source(url)
        key = fs._strip_protocol(url) + "/__0_0.distcp"
        fs.pipe_file(key, fs.cat_file(key))  # the same bytes, rewritten: a new identity
        with pytest.raises(ObjectStoreError) as e:
            src.read([Region("model.head.bias", (0,), (7,))], torch.device("cpu"))
        assert "changed while it was read" in one_line(e.value)
        src.close()
    finally:
        fsspec.filesystem("memory").rm(fs._strip_protocol(url), recursive=True)


# -- save and load --------------------------------------------------------------------------------
def test_save_to_a_url_then_audit_deep_and_load(s3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    url = s3.url("saved")
    manifest = fsdpcheck.save(model, url, optimizer=opt)
    assert s3.fs.exists(s3.key("saved/fsdpcheck_manifest.json"))
    assert manifest.saves and set(manifest.saves) == {"."}
    assert fsdpcheck.describe_path(url).layout == "fsdpcheck"
    report = fsdpcheck.audit(url, deep=True)
    assert report.ok and not report.notes, str(report)
    with pytest.raises(FileExistsError):
        fsdpcheck.save(model, url)
    # A byte of a tensor changed in the store: --deep names it (fingerprint against manifest).
    key = s3.key("saved/__0_0.distcp")
    raw = bytearray(s3.fs.cat_file(key))
    w = model[0].weight.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    at = bytes(raw).find(w)
    assert at > 0
    raw[at + 4 * 37] ^= 0x40
    s3.fs.pipe_file(key, bytes(raw))
    bad = fsdpcheck.audit(url, deep=True)
    assert [f.key for f in bad.findings] == ["0.weight"], str(bad)
    # Overwritten whole, then loaded into a fresh model and checked against the manifest.
    fsdpcheck.save(model, url, optimizer=opt, overwrite=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    fopt = torch.optim.AdamW(fresh.parameters())
    r = fsdpcheck.load(fresh, url, optimizer=fopt)
    assert r.ok, str(r)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert json.loads(s3.fs.cat_file(s3.key("saved/fsdpcheck_manifest.json")))["world_size"] == 1


# -- the pieces, against references -----------------------------------------------------------
@given(
    data=st.binary(min_size=1, max_size=300),
    pieces=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 80)), max_size=6),
    start=st.integers(0, 299),
    n=st.integers(0, 120),
)
def test_fill_from_takes_what_is_held_and_names_the_rest(data, pieces, start, n):
    held = [(a, data[a : a + k]) for a, k in pieces if a < len(data)]
    start = min(start, len(data))
    n = min(n, len(data) - start)
    out = bytearray(b"\xee" * n)
    gaps = R.fill_from(held, start, memoryview(out))
    covered = set()
    for a, piece in held:
        covered.update(range(a, a + len(piece)))
    want_gaps = []
    for i in range(start, start + n):  # the reference: byte by byte
        if i in covered:
            assert out[i - start] == data[i]
        elif want_gaps and want_gaps[-1][1] == i:
            want_gaps[-1] = (want_gaps[-1][0], i + 1)
        else:
            want_gaps.append((i, i + 1))
    assert gaps == want_gaps


@settings(max_examples=25)
@given(data=st.binary(min_size=0, max_size=5000), sizes=st.lists(st.integers(1, 1500), max_size=12))
def test_an_object_streams_as_its_bytes(data, sizes):
    """``.metadata`` is read through this stream: any read sizes give the object's bytes."""
    import fsspec

    key = f"/fsdpcheck-stream-{uuid.uuid4().hex[:8]}/obj"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(key, data)
    try:
        stream = R.open_object(R.RemotePath.parse(f"memory://{key}"), "test").stream(window=700)
        got = b""
        for n in [*sizes, 10_000]:
            got += stream.read(n)
        assert got == data and stream.read(10) == b""
        stream.seek(0)
        assert stream.read(len(data) + 1) == data
    finally:
        fs.rm(key.rsplit("/", 1)[0], recursive=True)


def test_names_a_checkpoint_may_give_its_files():
    assert R.name_problem("__0_0.distcp") is None and R.name_problem("sub/x.distcp") is None
    for bad in ("../x", "a/../../x", "/etc/passwd", "C:x", "a\\b", "", ".", "a\x00b"):
        assert R.name_problem(bad) is not None, bad
    url = R.RemotePath.parse("s3://bkt/run/step-1/")
    assert str(url) == "s3://bkt/run/step-1" and str(url / "./x/" / ".metadata") == (
        "s3://bkt/run/step-1/x/.metadata"
    )
    assert (url / "m.safetensors").suffix == ".safetensors" and url.parent.name == "run"
    assert R.location("file:///tmp/a%20b") == Path("/tmp/a b")
    assert R.location("/tmp/x") == "/tmp/x" and not R.is_url("file:///x") and R.is_url("gs://b/k")
