"""The command line: every command, --json, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import fsdpcheck
from fsdpcheck.cli import main


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    fsdpcheck.save(m, d / "ck", optimizer=opt)
    sd = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
    save_file(sd, str(d / "good.safetensors"))
    bad = dict(sd)
    bad["0.weight"] = sd["0.weight"].clone()
    bad["0.weight"][2, 3] = 0
    save_file(bad, str(d / "bad.safetensors"))
    torch.save({"model": sd}, d / "full.pt")
    return d


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", str(ckpts / "ck"))
    assert code == 0
    assert "written by fsdpcheck.save" in out and "manifest: format v1" in out
    assert "layout: fsdpcheck (sharded)" in out
    assert "model.0.weight" in out and "(7, 5)" in out and "complete" in out
    code, out, _ = run(capsys, "inspect", str(ckpts / "ck"), "--show-mapping")
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert ["model.0.weight", "model", "0.weight"] in rows
    assert ["optim.state.0.bias.exp_avg", "state", "optim.state.0.bias.exp_avg"] in rows
    code, out, _ = run(capsys, "inspect", str(ckpts / "ck"), "--json")
    info = json.loads(out)
    assert info["kind"] == "sharded" and info["optimizer_params"] == 4
    assert info["layout"] == "fsdpcheck" and info["model_tensors"] == 4
    assert info["optimizer_tensors"] == 12 and info["param_groups"] == 4  # per parameter
    assert {t["key"] for t in info["tensors"]} >= {"model.0.weight", "optim.state.0.bias.step"}
    code, out, _ = run(capsys, "inspect", str(ckpts / "good.safetensors"), "--json")
    assert json.loads(out)["kind"] == "full"


def test_compare_conversion_against_source(ckpts, capsys):
    # The training checkpoint's optimizer state has no counterpart in a model-only file: not
    # OK (nothing disappears silently) unless the user excludes it.
    code, out, _ = run(capsys, "compare", str(ckpts / "good.safetensors"), str(ckpts / "ck"))
    assert code == 1, out
    # ONE line for the optimizer state only one side holds, not one per tensor.
    assert out.count("[missing] optim.state") == 1 and "--ignore 'optim.*'" in out
    assert "12 tensors of 4 parameters" in out
    assert "4 keys on actual, 16 on expected, 4 compared, 0 skipped" in out
    code, out, _ = run(
        capsys,
        "compare",
        str(ckpts / "good.safetensors"),
        str(ckpts / "ck"),
        "--ignore",
        "optim.*",
        "--show-mapping",
    )
    assert code == 0, out
    assert (
        "4 keys on actual, 16 on expected, 4 compared, 12 skipped (12 excluded by the user)" in out
    )
    assert "0.weight" in out and "model.0.weight" in out and "ignored" in out
    code, out, _ = run(capsys, "compare", str(ckpts / "bad.safetensors"), str(ckpts / "ck"))
    assert code == 1
    assert "Mismatched elements: 1 / 35 (2.9%)" in out and "at index (2, 3)" in out
    code, out, _ = run(
        capsys,
        "compare",
        str(ckpts / "bad.safetensors"),
        str(ckpts / "full.pt"),
        "--json",
        "--memory-budget",
        "64",
    )
    report = json.loads(out)
    assert code == 1 and report["findings"][0]["max_abs_index"] == [2, 3]
    code, out, _ = run(
        capsys, "compare", str(ckpts / "bad.safetensors"), str(ckpts / "full.pt"), "--atol", "1"
    )
    assert code == 0


def test_fingerprint_command_matches_the_library(ckpts, capsys):
    code, out, _ = run(capsys, "fingerprint", str(ckpts / "ck"), "--json")
    assert code == 0
    fps = {k: int(v, 16) for k, v in json.loads(out).items()}
    assert fps == fsdpcheck.fingerprint_checkpoint(ckpts / "ck")
    code, out, _ = run(capsys, "fingerprint", str(ckpts / "full.pt"))
    assert "0.weight" in out and "0x" in out


def test_audit_exit_codes(ckpts, capsys, tmp_path):
    assert run(capsys, "audit", str(ckpts / "ck"))[0] == 0
    code, out, _ = run(capsys, "audit", str(ckpts / "ck"), "--deep", "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"garbage")
    code, out, _ = run(capsys, "audit", str(broken))
    assert code == 1 and "[error]" in out
    # Unreadable input is exit 2 in every command, audit included; --json stays valid JSON.
    for command in ("audit", "inspect", "fingerprint"):
        code, out, err = run(capsys, command, str(tmp_path / "nope"), "--json")
        assert code == 2 and json.loads(out)["ok"] is False and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert run(capsys, "audit", str(tmp_path / "empty"))[0] == 2


def test_errors_are_one_line_with_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err
    # Bad usage: exit 2 and one line naming the command, the problem and where the usage is.
    code, out, err = run(capsys, "compare", "onlyone")
    assert (
        code == 2
        and out == ""
        and err
        == (
            "fsdpcheck compare: error: the following arguments are required: expected "
            "(fsdpcheck compare --help shows the usage)\n"
        )
    )
    for budget in ("lots", "0", "-1", "infG", "nan"):
        code, _, err = run(capsys, "fingerprint", "x", "--memory-budget", budget)
        assert code == 2 and err.count("\n") == 1 and "not a positive size" in err
    # --debug adds the traceback; the exit code stays the same.
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope"), "--debug")
    assert code == 2 and "Traceback" in err
    assert main([]) == 2


@pytest.mark.slow
def test_closed_pipe_is_not_an_error(ckpts):
    cmd = f"{sys.executable} -m fsdpcheck inspect {ckpts / 'ck'} | head -c 10"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_python_dash_m_works(ckpts):
    out = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "audit", str(ckpts / "ck"), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and json.loads(out.stdout)["ok"]
    help_out = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "--help"], capture_output=True, text=True
    )
    assert "Examples:" in help_out.stdout and help_out.returncode == 0
    # A finding: exit code 1 and the whole report, through the exit that skips teardown.
    found = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "compare", str(ckpts / "bad.safetensors"),
         str(ckpts / "good.safetensors"), "--json"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    report = json.loads(found.stdout)
    assert found.returncode == 1 and report["findings"][0]["max_abs_index"] == [2, 3]
    # Bad usage: 2, with the one-line error on stderr.
    bad = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "inspect", str(ckpts / "nope")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


# ---------------------------------------------------------------------------------------------
# Nothing read from a file reaches the terminal raw.
FORGED = {
    "ok_line": "w\nfsdpcheck: OK: 1 keys on actual, 1 on expected, 1 compared, 0 skipped",
    "finding": "b\n[value] forged.weight",
    "recolour": "c\x1b[2K\r\x1b[32mfsdpcheck: OK\x1b[0m",
    "nul_rtl": "d\x00\u202egnp.exe",
}


def assert_shown(text: str) -> list[str]:
    """Every line printable (no CR, ESC, NUL, bidi override); the lines."""
    lines = text.split("\n")
    for line in lines:
        assert line.isprintable(), f"a raw character reached the terminal: {line!r}"
    return [ln for ln in lines if ln]


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("forged")
    actual = {k: torch.ones(3) for k in FORGED.values()}
    expected = dict(actual)
    expected[FORGED["finding"]] = torch.tensor([1.0, 2.0, 1.0])
    del expected[FORGED["nul_rtl"]]
    save_file(actual, str(d / "a.safetensors"))
    save_file(expected, str(d / "b.safetensors"))
    # A DCP directory whose name and keys carry the same characters.
    ck = d / "ck\n[value] dir.weight\x1b[31m"
    dcp.save(dict(actual), checkpoint_id=str(ck), no_dist=True)
    return d, ck


def test_keys_cannot_forge_a_line_a_verdict_or_a_colour(forged, capsys):
    d, ck = forged
    code, out, err = run(
        capsys, "compare", str(d / "a.safetensors"), str(d / "b.safetensors"), "--show-mapping"
    )
    lines = assert_shown(out + err)
    assert code == 1
    assert [ln for ln in lines if ln.startswith("fsdpcheck:")] == [lines[0]]
    assert lines[0].startswith("fsdpcheck: FAILED with 2 finding(s)")
    assert [ln for ln in lines if ln.startswith("[")] == [
        "[value] b\\n[value] forged.weight",
        "[unexpected] d\\x00\\u202egnp.exe: in actual but not in expected; --key-map OLD=NEW "
        "(key_map=) if they name it differently, --ignore (ignore=) to leave it out",
    ]
    assert "  c\\x1b[2K\\r\\x1b[32mfsdpcheck: OK\\x1b[0m" in out
    # --json stays exact: the keys as the file holds them.
    code, out, _ = run(capsys, "compare", str(d / "a.safetensors"), str(d / "b.safetensors"),
                       "--json")  # fmt: skip
    report = json.loads(out)
    assert {f["key"] for f in report["findings"]} == {FORGED["finding"], FORGED["nul_rtl"]}
    assert {r["a"] for r in report["mapping"]} == set(FORGED.values())
    for command in ("inspect", "fingerprint", "audit"):
        for target in (d / "a.safetensors", ck):
            code, out, err = run(capsys, command, str(target))
            lines = assert_shown(out + err)
            assert code == 0, (command, out, err)
            assert not [ln for ln in lines if ln.startswith(("fsdpcheck: OK", "[value]"))][1:]
            assert not any(ln.startswith(("[value] forged", "[value] dir")) for ln in lines)
    code, out, _ = run(capsys, "fingerprint", str(ck), "--json")
    assert set(json.loads(out)) == set(FORGED.values())
    code, out, _ = run(capsys, "fingerprint", str(ck))
    assert len(out.splitlines()) == len(FORGED)


def test_an_error_line_shows_the_path_escaped(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", str(tmp_path / "x\nfsdpcheck: OK\x1b[32m"))
    assert code == 2 and err.count("\n") == 1
    assert_shown(err)
    assert "x\\nfsdpcheck: OK\\x1b[32m" in err


def test_inspect_exits_1_when_it_lists_a_problem(ckpts, capsys, tmp_path):
    import shutil

    d = shutil.copytree(ckpts / "ck", tmp_path / "ck")
    data = next(d.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # storage entries now lie past its end
    code, out, _ = run(capsys, "inspect", str(d))
    assert code == 1 and "[error]" in out, out
    code, out, _ = run(capsys, "inspect", str(d), "--json")
    assert code == 1 and json.loads(out)["problems"]
    assert run(capsys, "inspect", str(ckpts / "ck"))[0] == 0


def test_compare_refuses_meta_tensors(ckpts, capsys):
    code, _, err = run(
        capsys, "compare", str(ckpts / "good.safetensors"), str(ckpts / "ck"), "--device", "meta"
    )
    assert code == 2 and "meta tensors hold no values" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("stop", "code", "error"),
    [
        (
            KeyboardInterrupt(),
            130,
            "interrupted by SIGINT before the check finished; nothing was concluded",
        ),
        (
            OSError(5, "Input/output error", "ck/__0_0.distcp"),
            2,
            "ck/__0_0.distcp: Input/output error",
        ),
    ],
)
def test_inspect_json_stopped_half_way_is_still_one_document(
    ckpts, capsys, monkeypatch, stop, code, error
):
    """inspect --json writes its tensors as they come: what stops it ends the document."""
    import contextlib

    from fsdpcheck import inspection

    real = inspection.inspecting

    @contextlib.contextmanager
    def stopping(path):
        with real(path) as (info, tensors, count):

            def first_then_stop():
                yield next(iter(tensors()))
                raise stop

            yield info, first_then_stop, count

    monkeypatch.setattr(inspection, "inspecting", stopping)
    got, out, err = run(capsys, "inspect", str(ckpts / "ck"), "--json")
    doc = json.loads(out)
    assert got == code and doc["exit_code"] == code and doc["ok"] is False
    assert doc["error"] == error and len(doc["tensors"]) == 1 and doc["path"] == str(ckpts / "ck")
    assert err == f"fsdpcheck inspect: {error}\n"
