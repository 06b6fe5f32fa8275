"""verify through a conversion in one process: what the conversion leaves out on purpose, what it
forgets, and a conversion that cannot be followed, each said once."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fsdpcheck


class Tiny(nn.Module):
    """A model with a tied head and a persistent rotary cache buffer (torchtitan's freqs_cis)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("freqs_cis", torch.randn(3), persistent=True)


def to_hf(sd):
    return {"model.embed.weight": sd["tok.weight"], "model.proj.weight": sd["proj.weight"].t()}


def test_tied_duplicates_and_buffers_left_out_are_listed_not_findings(tmp_path):
    m = Tiny()
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in to_hf(m.state_dict()).items()}, str(path))
    r = fsdpcheck.verify(m, path, convert=to_hf)
    assert r.ok, str(r)
    rows = {row.a: row.reason for row in r.mapping if row.status == "ignored"}
    assert rows["head.weight"] == "left out by the conversion: tied to tok.weight"
    assert "rotary cache" in rows["freqs_cis"]


def test_a_parameter_the_conversion_forgets_is_unexpected(tmp_path):
    m = Tiny()
    path = tmp_path / "m.safetensors"
    save_file({"model.embed.weight": m.tok.weight.detach().clone()}, str(path))
    r = fsdpcheck.verify(m, path, convert=lambda sd: {"model.embed.weight": sd["tok.weight"]})
    assert [(f.key, f.kind) for f in r.findings] == [("proj.weight", "unexpected")]
    assert (
        "16 of its 16 elements live are in no tensor the conversion writes" in r.findings[0].message
    )


def test_a_conversion_that_is_not_a_strided_map_is_one_error(tmp_path):
    m = Tiny()
    path = tmp_path / "m.safetensors"
    save_file({"model.embed.weight": m.tok.weight.detach().clone()}, str(path))
    r = fsdpcheck.verify(m, path, convert=lambda sd: {"model.embed.weight": sd["tok.weight"] * 2})
    (f,) = r.findings
    assert f.kind == "error" and "aten.mul" in f.message and "tok.weight" in f.message
    with pytest.raises(fsdpcheck.FingerprintError, match=r"aten\.add"):
        fsdpcheck.fingerprint(m, convert=lambda sd: {"x": sd["tok.weight"] + 1})


class Plain(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 6, bias=False)
        self.b = nn.Linear(6, 2)


def test_load_checks_through_the_conversion_it_is_given(tmp_path):
    """What load checks after loading goes through convert= (the manifest and the files)."""
    fsdpcheck.save(Plain(0), tmp_path / "ckpt")
    seen = []

    def same(sd):  # the identity, stated as a conversion: every key as it is
        seen.append(sorted(sd))
        return dict(sd)

    for verify in ("fingerprint", "full"):
        m = Plain(1)
        r = fsdpcheck.load(m, tmp_path / "ckpt", verify=verify, convert=same)
        assert r.ok, (verify, str(r))
        assert seen[-1] == ["a.weight", "b.bias", "b.weight"]
    seen.clear()
    m = Plain(1)
    # A conversion whose layout the checkpoint does not have: the check says so.
    r = fsdpcheck.load(
        m, tmp_path / "ckpt", verify="full", convert=lambda sd: {"x": sd["a.weight"]}
    )
    assert not r.ok and any(f.key == "x" for f in r.findings)
