"""The layout registry: recognition from marker files, key grammars, part roles, prefixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpcheck import matching
from fsdpcheck.formats import LAYOUTS, describe_path, grammar_of, layout_named
from fsdpcheck.formats.base import DEFAULT_GRAMMAR, CheckpointInfo, KeyGrammar, OptimPath
from fsdpcheck.keys import keys_from_entries
from fsdpcheck.sources.base import Entry


def test_registry_names_are_unique_and_resolvable():
    names = [layout.name for layout in LAYOUTS]
    assert len(names) == len(set(names)) and all(names)
    for n in names:
        assert layout_named(n) is not None and isinstance(grammar_of(n), KeyGrammar)
    assert grammar_of("no such layout") is DEFAULT_GRAMMAR


def _dcp(p: Path, *extra: str) -> Path:
    p.mkdir(parents=True)
    (p / ".metadata").write_bytes(b"x")
    for name in extra:
        (p / name).write_bytes(b"{}")
    return p


@pytest.mark.parametrize(
    ("build", "layout", "parts"),
    [
        (lambda p: _dcp(p / "c", "fsdpcheck_manifest.json"), "fsdpcheck", ["c"]),
        (lambda p: _dcp(p / "step-10"), "torchtitan", ["step-10"]),
        (lambda p: _dcp(p / "c", "meta.pt"), "lightning", ["c"]),
        (lambda p: _dcp(p / "c"), "dcp", ["c"]),
    ],
)
def test_dcp_layouts_by_marker(tmp_path, build, layout, parts):
    info = describe_path(build(tmp_path))
    assert info.layout == layout and info.kind == "sharded"
    assert [q.name for q in info.parts] == parts


def test_megatron_by_its_metadata_json(tmp_path):
    d = _dcp(tmp_path / "m")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (d / "common.pt").write_bytes(b"")
    info = describe_path(d)
    assert info.layout == "megatron" and "common.pt" in info.notes[0]
    assert grammar_of("megatron").state_name_first and not grammar_of("megatron").step_per_parameter


def test_trainer_folder_roles_and_training_state(tmp_path):
    d = tmp_path / "checkpoint-4"
    d.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "training_args.bin",
    ):
        (d / name).write_bytes(b"")
    info = describe_path(d)
    assert info.layout == "hf-trainer" and info.kind == "full"
    assert [q.name for q in info.parts] == ["model.safetensors", "optimizer.pt"]
    assert info.roles == ["model", "optimizer"]
    assert [q.name for q in info.training] == [
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    ]
    assert "training state not compared" in info.notes[0]


def test_trainer_folder_under_fsdp_is_sharded(tmp_path):
    d = tmp_path / "checkpoint-4"
    d.mkdir()
    (d / "trainer_state.json").write_text("{}")
    _dcp(d / "pytorch_model_fsdp_0")
    _dcp(d / "optimizer_0")
    info = describe_path(d)
    assert info.kind == "sharded" and [q.name for q in info.parts] == [
        "pytorch_model_fsdp_0",
        "optimizer_0",
    ]


def test_peft_adapter_folder_and_file(tmp_path):
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")
    assert describe_path(d).roles == ["adapter"]
    assert describe_path(d / "adapter_model.safetensors").layout == "peft"
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_config\.json but no adapter_model"):
        describe_path(d)


def test_checkpoint_info_checks_its_roles():
    with pytest.raises(ValueError, match="roles"):
        CheckpointInfo(Path("x"), "dcp", "full", "", [Path("a")], roles=["model", "optimizer"])
    with pytest.raises(ValueError, match="roles"):
        CheckpointInfo(Path("x"), "dcp", "full", "", [Path("a")], roles=["weights"])


# ---------------------------------------------------------------------------------------------
def test_megatron_optimizer_keys_name_the_state_first():
    g = grammar_of("megatron")
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    assert g.optim_path((key,)) == OptimPath(
        "state", "decoder.layers.mlp.linear_fc1.weight", "exp_avg"
    )
    # The default grammar reads torch's order: state.<fqn>.<name>.
    assert DEFAULT_GRAMMAR.optim_path(("optimizer.state.a.b.exp_avg",)) == OptimPath(
        "state", "a.b", "exp_avg"
    )
    entries = {
        "decoder.w": Entry("decoder.w", ("decoder.w",), (4,), torch.float32),
        key: Entry(key, (key,), (4,), torch.float32),
    }
    keys = keys_from_entries(entries, grammar=g)
    assert list(keys.state) == [("decoder.layers.mlp.linear_fc1.weight", "exp_avg")]
    assert list(keys.model) == ["decoder.w"]


def test_part_roles_decide_over_key_shapes():
    entries = {
        "state.x.exp_avg": Entry("state.x.exp_avg", ("state.x.exp_avg",), (2,), torch.float32),
        "bert.w": Entry("bert.w", ("bert", "w"), (2,), torch.float32),
    }
    # A weights file holds model tensors, whatever their names look like.
    model = keys_from_entries(entries, role="model")
    assert sorted(model.model) == ["bert.w", "state.x.exp_avg"] and not model.state
    # An optimizer file's other entries are training state, never model tensors.
    optim = keys_from_entries(entries, role="optimizer")
    assert list(optim.state) == [("x", "exp_avg")] and [r.key for r in optim.other] == ["bert.w"]


# ---------------------------------------------------------------------------------------------
def test_prefix_pair_both_ways_and_at_scale():
    a = [f"layers.{i}.w" for i in range(10)]
    assert matching.prefix_pair(a, [f"model.{n}" for n in a]) == ("", "model.")
    assert matching.prefix_pair([f"model.{n}" for n in a], a) == ("model.", "")
    assert matching.prefix_pair(a, a) == ("", "")
    # A million names: candidates come from an index of name tails, not a scan per sample.
    big = [f"layers.{i}.mlp.w{j}" for i in range(100_000) for j in range(10)]
    assert matching.prefix_pair(big, [f"m.{n}" for n in big]) == ("", "m.")


def test_prefix_rules_parse_and_refuse():
    rules = matching.prefix_rules(["model.=", "a.=b."])
    assert rules.rename("model.x") == "x" and rules.rename("a.y") == "b.y"
    assert rules.rename("c.z") == "c.z"
    assert matching.prefix_rules({"model.": ""}).rename("model.q") == "q"
    with pytest.raises(ValueError, match="is not OLD=NEW"):
        matching.prefix_rules(["model."])
    with pytest.raises(ValueError, match="changes nothing"):
        matching.prefix_rules(["x.=x."])


def test_public_api_is_listed_once_everywhere():
    import ast
    import inspect

    import fsdpcheck
    import fsdpcheck.errors as errors

    source = inspect.getsource(fsdpcheck)
    tree = ast.parse(source)
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                typed |= {a.asname or a.name for a in imp.names}  # type: ignore[attr-defined]
    exported = set(fsdpcheck._EXPORTS)
    assert set(fsdpcheck.__all__) - {"__version__"} == exported == typed
    for name in exported:
        assert getattr(fsdpcheck, name) is not None
    # Every exception fsdpcheck raises on purpose is one of the vocabulary's.
    for name in ("CheckpointError", "ManifestError", "FingerprintError", "CheckpointKindError",
                 "RankStoppedError", "VerificationError"):  # fmt: skip
        assert issubclass(getattr(fsdpcheck, name), errors.FsdpcheckError)
    assert issubclass(fsdpcheck.CheckpointError, ValueError)
    assert issubclass(fsdpcheck.RankStoppedError, RuntimeError)
