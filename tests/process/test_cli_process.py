"""The command line as scripts see it: the real console script, in a process of its own.

* Exit codes are the verdict: a reader that leaves early (``| head``, EPIPE) keeps it; a report
  that cannot be written (``/dev/full``, a closed stdout) turns a pass into 2 and keeps a
  finding 1, with one line on stderr and no traceback.
* ``--json``: stdout is one valid JSON document in every case (usage errors, unknown options,
  ``--help``, unreadable input, interruptions).
* SIGINT / SIGTERM: exit 130 / 143 within seconds, at several points (while torch is imported,
  in the middle of a check, in the demo before, while and after its ranks work), the demo's
  ranks and temporary files gone.
* The hostile-input residue, with their exact messages: a ``.metadata`` claiming a
  ``[2**32, 2**32]`` tensor (one line, bounded memory), a storage offset of 2**63 - 1, claims
  past 2**63 - 1.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

FSDPCHECK = Path(sys.executable).parent / "fsdpcheck"
pytestmark = pytest.mark.skipif(not FSDPCHECK.exists(), reason=f"no console script {FSDPCHECK}")

N = 3000  # tensors, each one a finding in `bad`: ~700 kB of report, far more than a pipe holds


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("cliproc")
    good = {f"t{i:04d}": torch.full((4,), float(i)) for i in range(N)}
    save_file(good, str(d / "a.safetensors"))
    save_file({k: v + 1 for k, v in good.items()}, str(d / "bad.safetensors"))
    return d


def sh(script: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`script` in bash with pipefail: a pipeline's status is its first failing command's."""
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fsdpcheck(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FSDPCHECK), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1. Exit codes under closed pipes and unwritable output.
def test_a_reader_that_leaves_early_never_changes_the_verdict(files: Path) -> None:
    F = FSDPCHECK
    out = sh(f"{F} compare a.safetensors bad.safetensors | head -1", files)
    assert out.returncode == 1, out
    assert out.stdout.startswith(f"fsdpcheck: FAILED with {N} finding(s)") and out.stderr == ""
    out = sh(f"{F} compare --json a.safetensors bad.safetensors | head -c 200", files)
    assert (out.returncode, out.stderr, len(out.stdout)) == (1, "", 200), out
    # Passing checks stay 0 (what the reader did not read, it did not want).
    for cmd in ("compare a.safetensors a.safetensors", "inspect --json a.safetensors"):
        out = sh(f"{F} {cmd} | head -c 10", files)
        assert (out.returncode, out.stderr) == (0, ""), (cmd, out)


_LOST = {
    "/dev/full": ("> /dev/full", "No space left on device"),
    "closed stdout": (">&-", "stdout is closed"),
}


@pytest.mark.parametrize("where", sorted(_LOST))
def test_a_report_that_cannot_be_written_is_one_line_and_never_a_pass(
    files: Path, where: str
) -> None:
    redirect, why = _LOST[where]
    F = FSDPCHECK
    # --json on one of the two (the human report on the other), in turn.
    json_failed, json_passed = ("--json ", "") if where == "/dev/full" else ("", "--json ")
    failed = sh(f"{F} compare {json_failed}a.safetensors bad.safetensors {redirect}", files)
    assert failed.returncode == 1, failed
    assert one_line(failed.stderr) == (
        f"fsdpcheck compare: the report could not be written to stdout ({why}); the check found "
        "problems (exit 1); send stdout where it can be written"
    )
    passed = sh(f"{F} compare {json_passed}a.safetensors a.safetensors {redirect}", files)
    assert passed.returncode == 2, passed
    assert one_line(passed.stderr) == (
        f"fsdpcheck compare: the report could not be written to stdout ({why}); exit 2, though "
        "the check passed; send stdout where it can be written"
    )
    # With stderr gone too: the same exit code, and nothing crashes.
    out = sh(f"{F} compare a.safetensors bad.safetensors {redirect} 2>&-", files)
    assert out.returncode == 1, out


# ---------------------------------------------------------------------------------------------
# 2. --json: one document in every case.
_JSON_CASES: dict[str, tuple[list[str], int, str]] = {
    "a missing argument": (
        ["compare", "--json", "a.safetensors"],
        2,
        "the following arguments are required: expected (fsdpcheck compare --help shows the usage)",
    ),
    "an unknown option": (
        ["compare", "--json", "--bogus", "a.safetensors", "bad.safetensors"],
        2,
        "unrecognized arguments: --bogus (fsdpcheck compare --help shows the usage)",
    ),
    "no command": (
        ["--json"],
        2,
        "unrecognized arguments: --json (fsdpcheck --help shows the usage)",
    ),
    "an invalid value": (
        ["fingerprint", "a.safetensors", "--json", "--memory-budget", "lots"],
        2,
        "argument --memory-budget: not a positive size: 'lots' (e.g. 1G, 512M) (fsdpcheck "
        "fingerprint --help shows the usage)",
    ),
    "unreadable input": (
        ["inspect", "--json", "nope"],
        2,
        "checkpoint nope does not exist (looked for {cwd}/nope; give the path of a checkpoint "
        "directory or file)",
    ),
    "a demo that cannot run": (
        ["demo", "--json", "--ranks", "1"],
        2,
        "the demo needs at least 2 ranks (--ranks 1): it swaps shards between two",
    ),
}


@pytest.mark.parametrize("case", sorted(_JSON_CASES))
def test_json_errors_are_one_document(files: Path, case: str) -> None:
    argv, code, error = _JSON_CASES[case]
    error = error.replace("{cwd}", str(files))
    out = fsdpcheck(*argv, cwd=files)
    assert out.returncode == code, out
    assert json.loads(out.stdout) == {"ok": False, "error": error, "exit_code": code}
    assert error in one_line(out.stderr)


def test_json_verdicts_help_and_info_are_one_document(files: Path) -> None:
    out = fsdpcheck("compare", "--json", "a.safetensors", "bad.safetensors", cwd=files)
    doc = json.loads(out.stdout)
    assert out.returncode == 1 and doc["ok"] is False and len(doc["findings"]) == N
    out = fsdpcheck("inspect", "--json", "a.safetensors", cwd=files)
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] is True and len(doc["tensors"]) == N
    out = fsdpcheck("compare", "--help", "--json", cwd=files)
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] and doc["help"].startswith("usage: fsdpcheck compare")
    out = fsdpcheck("info", "--json", cwd=files)
    assert out.returncode == 0 and "cpu" in json.loads(out.stdout)["backends"]


# ---------------------------------------------------------------------------------------------
# 3. Signals.
def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _maps(pid: int, name: str) -> bool:
    """Whether process `pid` has a library named `name` mapped (torch's import has begun)."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (by /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent reaps it)


def _slow_convert(d: Path) -> None:
    """A --convert function that marks when it runs, then works for a minute (a long check)."""
    (d / "slowconv.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib, time

            def convert(sd):
                pathlib.Path(os.environ["FSDPCHECK_TEST_MARK"]).touch()
                time.sleep(60)
                return sd
            """
        )
    )


_STOPPED = {
    signal.SIGINT: "interrupted by SIGINT before the check finished; nothing was concluded",
    signal.SIGTERM: "interrupted by SIGTERM before the check finished; nothing was concluded",
}


@pytest.mark.parametrize("point", ["importing torch", "in the middle of the check"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_is_exit_130_or_143_and_one_json_document(
    files: Path, tmp_path: Path, point: str, sig: signal.Signals
) -> None:
    _slow_convert(tmp_path)
    mark = tmp_path / "mark"
    env = dict(os.environ, FSDPCHECK_TEST_MARK=str(mark), PYTHONPATH=str(tmp_path))
    argv = ["compare", "--json", str(files / "a.safetensors"), str(files / "bad.safetensors"),
            "--convert", "slowconv:convert"]  # fmt: skip
    p = subprocess.Popen([str(FSDPCHECK), *argv], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        if point == "importing torch":
            _wait_for(lambda: _maps(p.pid, "libtorch"), "torch's import")
        else:
            _wait_for(mark.exists, "the check to start")
        p.send_signal(sig)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert took < 10, took
    assert one_line(err) == f"fsdpcheck compare: {_STOPPED[sig]}"
    assert json.loads(out) == {"ok": False, "error": _STOPPED[sig], "exit_code": 128 + sig}


_DEMO_POINTS = {
    # (signal, to the whole process group (a Ctrl-C), when)
    "SIGINT before the ranks start": (signal.SIGINT, False, "torch"),
    "SIGINT while the ranks train": (signal.SIGINT, False, "ranks"),
    "SIGINT after the checkpoint is saved": (signal.SIGINT, False, "saved"),
    "Ctrl-C to the process group while the ranks work": (signal.SIGINT, True, "ranks"),
    "SIGTERM while the ranks train": (signal.SIGTERM, False, "ranks"),
}


@pytest.mark.parametrize("case", list(_DEMO_POINTS))
def test_an_interrupted_demo_leaves_no_rank_and_no_file(tmp_path: Path, case: str) -> None:
    sig, group, when = _DEMO_POINTS[case]
    scratch = tmp_path / "tmp"  # the demo's temporary directory goes here
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    p = subprocess.Popen([str(FSDPCHECK), "demo", "--ranks", "2"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)  # fmt: skip
    seen: set[int] = set()

    def reached() -> bool:
        seen.update(_descendants(p.pid))
        if p.poll() is not None:
            raise AssertionError(f"the demo ended first: {p.returncode}")
        if when == "torch":
            return _maps(p.pid, "libtorch")
        ranks = [c for c in seen if _alive(c) and _maps(c, "libtorch")]
        if when == "ranks":
            return len(ranks) >= 2
        return any(scratch.glob("*/ckpt/.metadata"))

    try:
        _wait_for(reached, case, timeout=240)
        seen.update(_descendants(p.pid))
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for c in _descendants(p.pid) | seen:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert took < 15, took
    assert one_line(err) == f"fsdpcheck demo: {_STOPPED[sig]}"
    if when != "torch":
        assert len(seen) >= 2  # the ranks were there
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in seen if _alive(c)], "a process the demo started outlived it"
    assert list(scratch.iterdir()) == [], "the demo left files behind"


# ---------------------------------------------------------------------------------------------
# 4. The hostile-input residue: claimed sizes and offsets, exact messages, bounded memory.
def _dcp(d: Path, edit: Callable[[Any], None]) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4, 4), "v": torch.ones(3)}, checkpoint_id=str(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())
    edit(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


def _claim_huge(md: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    t = md.state_dict_metadata["w"]
    t.size = torch.Size([2**32, 2**32])
    t.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**32, 2**32]))]


def _storage(key: str, **fields: int) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == key:
                for name, value in fields.items():
                    setattr(info, name, value)

    return edit


def _limited(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        # RLIMIT_DATA, not RLIMIT_AS: a CUDA build of torch reserves more than 3 GiB of address
        # space at import without using it; the data limit caps what is allocated.
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return preexec


def _measured(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the console script, its data segment capped at 3 GiB."""
    out = subprocess.run([str(FSDPCHECK), *argv], cwd=cwd, text=True, capture_output=True,
                         preexec_fn=_limited(3 << 30), timeout=120)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_a_claimed_2_32_by_2_32_tensor_is_one_line_in_bounded_memory(tmp_path: Path) -> None:
    ck = _dcp(tmp_path / "huge", _claim_huge)
    length = next(i.length for x, i in pickle.loads((ck / ".metadata").read_bytes())
                  .storage_data.items() if x.fqn == "w")  # fmt: skip
    claim = (
        f"w: chunk at offset (0, 0) declares 18446744073709551616 elements "
        f"(73786976294838206464 bytes) but its stored data has {length} bytes"
    )
    code, _, err = _measured(["fingerprint", str(ck)], tmp_path)
    assert code == 2
    assert one_line(err) == (
        f"fsdpcheck fingerprint: DCP checkpoint {ck}: error in {claim}; refusing to fingerprint "
        "it (fsdpcheck audit lists every problem)"
    )
    for argv in (["inspect", str(ck)], ["audit", str(ck)], ["audit", "--deep", str(ck)],
                 ["compare", str(ck), str(ck)]):  # fmt: skip
        code, out, err = _measured(argv, tmp_path)
        assert code == 1 and "Traceback" not in err and "MemoryError" not in out + err, argv
        if argv[0] != "inspect":
            assert f"[error] {claim}" in out or f"[error] w: actual: {claim[3:]}" in out, out
    code, out, _ = _measured(["inspect", "--json", str(ck)], tmp_path)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    assert [(p["key"], p["message"]) for p in doc["problems"]] == [("w", claim[3:])]
    assert [t["shape"] for t in doc["tensors"] if t["key"] == "w"] == [[2**32, 2**32]]


def test_claims_are_read_in_bounded_memory(tmp_path: Path) -> None:
    ck = _dcp(tmp_path / "huge", _claim_huge)
    small = _dcp(tmp_path / "small", lambda md: None)
    peaks = {}
    for name, argv in {
        "fingerprint": ["fingerprint", str(ck)],
        "compare": ["compare", str(ck), str(ck)],
        "baseline": ["fingerprint", str(small)],
    }.items():
        p = subprocess.Popen([str(FSDPCHECK), *argv], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=_limited(3 << 30))  # fmt: skip
        _, status, usage = os.wait4(p.pid, 0)  # this child's own peak
        p.returncode = os.waitstatus_to_exitcode(status)
        assert p.returncode == (0 if name == "baseline" else 2 if name == "fingerprint" else 1)
        peaks[name] = usage.ru_maxrss
    # What a 2-element checkpoint costs, within 200 MB: never the 2**66 bytes claimed (the same
    # command asked for 16 GiB blocks before, and died with MemoryError after 2.5 GB).
    for name in ("fingerprint", "compare"):
        assert peaks[name] < peaks["baseline"] + 200_000, peaks


def test_a_storage_offset_of_2_63_minus_1_names_the_file(tmp_path: Path) -> None:
    ck = _dcp(tmp_path / "off", _storage("w", offset=2**63 - 1))
    md = pickle.loads((ck / ".metadata").read_bytes())
    info = next(i for x, i in md.storage_data.items() if x.fqn == "w")
    size = (ck / info.relative_path).stat().st_size
    why = (
        f"its data ends at byte {2**63 - 1 + info.length} of {info.relative_path} but the file "
        f"has {size} bytes (truncated?)"
    )
    out = fsdpcheck("compare", str(ck), str(ck), cwd=tmp_path)
    assert out.returncode == 1 and out.stderr == ""
    assert f"[error] w: actual: {why}" in out.stdout and f"[error] w: expected: {why}" in out.stdout
    out = fsdpcheck("fingerprint", str(ck), cwd=tmp_path)
    assert out.returncode == 2
    assert one_line(out.stderr) == (
        f"fsdpcheck fingerprint: DCP checkpoint {ck}: error in w: {why}; refusing to fingerprint "
        "it (fsdpcheck audit lists every problem)"
    )
    out = fsdpcheck("audit", str(ck), cwd=tmp_path)
    assert out.returncode == 1 and f"[error] w: {why}" in out.stdout


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (_storage("w", offset=2**64), "w: storage offset 18446744073709551616 is past 2**63 - 1"),
        (_storage("w", length=2**70), "w: storage length 1180591620717411303424 is past 2**63 - 1"),
    ],
)
def test_claims_past_2_63_are_one_line_naming_the_file_and_key(
    tmp_path: Path, edit: Callable[[Any], None], said: str
) -> None:
    ck = _dcp(tmp_path / "ck", edit)
    expected = (
        f"DCP metadata {ck / '.metadata'}: {said}, which no tensor or file can hold; the "
        "metadata is corrupt (restore it from a copy, or save the checkpoint again)"
    )
    for command in ("fingerprint", "inspect"):
        out = fsdpcheck(command, str(ck), cwd=tmp_path)
        assert out.returncode == 2 and one_line(out.stderr) == f"fsdpcheck {command}: {expected}"
    out = fsdpcheck("audit", str(ck), cwd=tmp_path)
    assert out.returncode == 1 and f"[error] *: {expected}" in out.stdout


def test_a_size_past_2_63_is_one_line(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def edit(md: Any) -> None:
        t = md.state_dict_metadata["w"]
        t.size = torch.Size([2**64, 4])
        t.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))]

    ck = _dcp(tmp_path / "ck", edit)
    out = fsdpcheck("compare", str(ck), str(ck), cwd=tmp_path)
    assert out.returncode == 2 and one_line(out.stderr) == (
        f"fsdpcheck compare: DCP metadata {ck / '.metadata'}: w: size (18446744073709551616, 4) "
        "has an entry past 2**63 - 1, which no tensor or file can hold; the metadata is corrupt "
        "(restore it from a copy, or save the checkpoint again)"
    )


def test_a_failed_read_names_the_file_and_the_offset(tmp_path: Path) -> None:
    from fsdpcheck.errors import describe_error
    from fsdpcheck.sources.rawio import pread_into

    f = tmp_path / "data.bin"
    f.write_bytes(bytes(64))
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            pread_into(fd, torch.empty(16, dtype=torch.uint8), 2**63 - 1, "x", f)
    finally:
        os.close(fd)
    assert describe_error(e.value) == (
        f"{f}: Invalid argument (reading 16 bytes at byte 9223372036854775807)"
    )


def test_deep_audit_says_it_checked_the_structure_only_without_fingerprints(
    tmp_path: Path,
) -> None:
    ck = _dcp(tmp_path / "plain", lambda md: None)
    out = fsdpcheck("audit", "--deep", str(ck), cwd=tmp_path)
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].startswith(
        f"fsdpcheck: OK: 2 keys against the structure of {ck} (dcp) only: --deep checked no "
        "value (no fsdpcheck manifest holds fingerprints to check them against; fsdpcheck.save "
        "writes one);"
    ), out.stdout
    f = tmp_path / "m.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(f))
    out = fsdpcheck("audit", "--deep", "--json", str(f), cwd=tmp_path)
    doc = json.loads(out.stdout)
    assert (
        out.returncode == 0
        and doc["ok"]
        and doc["reference"].endswith(
            "only: --deep checked no value (no fsdpcheck manifest holds fingerprints to check them "
            "against; fsdpcheck.save writes one)"
        )
    )
