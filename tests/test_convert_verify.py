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
