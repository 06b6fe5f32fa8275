"""The layout registry: recognition from marker files, key grammars, part roles, prefixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpcheck import matching
from fsdpcheck.formats import LAYOUTS, describe_path, grammar_of, layout_named, readers
from fsdpcheck.formats.base import DEFAULT_GRAMMAR, CheckpointInfo, KeyGrammar, OptimPath, Part
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
    assert [q.name for q in info.paths] == parts


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
    assert [q.name for q in info.paths] == ["model.safetensors", "optimizer.pt"]
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
    assert info.kind == "sharded" and [q.name for q in info.paths] == [
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


def test_part_checks_its_role():
    with pytest.raises(ValueError, match="role 'weights'"):
        Part(Path("a"), "weights", readers.dcp)
    info = CheckpointInfo(Path("x"), "dcp", "full", "", [Part(Path("a"), "model", readers.dcp)])
    assert (info.paths, info.roles) == ([Path("a")], ["model"])


# ---------------------------------------------------------------------------------------------
def _folder(p: Path, *names: str) -> Path:
    """A folder holding empty files of those names; a name ending in / is a DCP folder."""
    p.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith("/"):
            _dcp(p / name[:-1])
        elif name:
            (p / name).parent.mkdir(parents=True, exist_ok=True)
            (p / name).write_bytes(b"")
    return p


def _by_suffix(path: Path) -> object:
    """A pure reference: the reader the part's path alone points to (shard names, index
    suffixes, a universal checkpoint's zero/ folder, a folder, a suffix)."""
    from fsdpcheck.formats.ds_universal import read_zero
    from fsdpcheck.formats.hf_storage import SHARD_NAME, read_shards

    names = [q.name for q in path.iterdir()] if path.is_dir() else [path.name]
    if any(SHARD_NAME.fullmatch(n) for n in names):
        return read_shards
    if path.name.endswith(".bin.index.json"):
        return readers.bin_index
    if path.name == "zero" and any(q.name.endswith("_states.pt") for q in path.parent.iterdir()):
        return read_zero
    if path.is_dir():
        return readers.dcp
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return readers.safetensors
    return readers.torch_save


SHARD = "shard-{}-model-1-of-1.safetensors"
# What describe_path is given, for each kind of part a layout finds: (folder, names in it, the
# file of it to pass or "" for the folder).
_KINDS = {
    "dcp": ("plain", [".metadata"], ""),
    "native": ("n", [".metadata", "fsdpcheck_manifest.json"], ""),
    "torchtitan": ("step-3", [".metadata"], ""),
    "lightning-dir": ("l", [".metadata", "meta.pt"], ""),
    "lightning-file": ("lf", ["last.ckpt"], "last.ckpt"),
    "trainer": ("checkpoint-1", ["trainer_state.json", "model.safetensors", "optimizer.pt"], ""),
    "trainer-fsdp": ("checkpoint-2", ["trainer_state.json", "pytorch_model_fsdp_0/",
                                      "optimizer_0/"], ""),
    "trainer-bin-index": ("checkpoint-3", ["trainer_state.json", "pytorch_model.bin.index.json"],
                          ""),
    "accelerate": ("acc", ["pytorch_model_fsdp_0/", "optimizer.bin"], ""),
    "accelerate-full": ("acc2", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"], ""),
    "peft": ("ad", ["adapter_config.json", "adapter_model.safetensors"], ""),
    "peft-bin": ("ad2", ["adapter_config.json", "adapter_model.bin"], "adapter_model.bin"),
    "hf-index": ("hf", ["config.json", "model.safetensors.index.json"], ""),
    "hf-bin-index": ("hfb", ["config.json", "pytorch_model.bin.index.json"], ""),
    "safetensors-folder": ("st", ["a.safetensors", "b.safetensors"], ""),
    "safetensors-file": ("st1", ["one.safetensors"], "one.safetensors"),
    "torch.save": ("ts", ["w.pt"], "w.pt"),
    "bin-index-file": ("bi", ["model.bin.index.json"], "model.bin.index.json"),
    "hf-shards": ("hs", [SHARD.format(1), SHARD.format(2)], ""),
    "hf-shard-file": ("hs1", [SHARD.format(1)], SHARD.format(1)),
    "hf-sharded-dir": ("hs2", [f"sharded/{SHARD.format(1)}"], ""),
    "deepspeed": ("ds", ["mp_rank_00_model_states.pt"], ""),
    "deepspeed-universal": ("u", ["mp_rank_00_model_states.pt", "zero/x"], ""),
    "one-torch-save-in-folder": ("f", ["model.pth"], ""),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_each_part_names_the_reader_its_path_points_to(tmp_path, kind):
    folder, names, given = _KINDS[kind]
    root = tmp_path / folder
    if ".metadata" in names:
        _dcp(root, *(n for n in names if n != ".metadata"))
    else:
        _folder(root, *names)
    info = describe_path(root / given)  # root / "": the folder itself
    assert info.parts
    for part in info.parts:
        assert part.reader is _by_suffix(Path(part.path)), (kind, part)


def test_flat_names_are_a_property_of_the_storage():
    from fsdpcheck.sources.bin_index import BinIndexSource
    from fsdpcheck.sources.dcp.source import DCPSource
    from fsdpcheck.sources.hf_storage import HFStorageSource
    from fsdpcheck.sources.memory import MemorySource
    from fsdpcheck.sources.remote_files import RemoteSafetensorsSource
    from fsdpcheck.sources.safetensors_files import SafetensorsSource
    from fsdpcheck.sources.torch_save import TorchSaveSource

    flat = [SafetensorsSource, HFStorageSource, RemoteSafetensorsSource]
    nested = [DCPSource, TorchSaveSource, BinIndexSource, MemorySource]
    assert [c.flat_names for c in flat] == [True] * 3
    assert [c.flat_names for c in nested] == [False] * 4
    assert not hasattr(KeyGrammar(), "flat_names")


def test_torchtitan_latest_step_is_one_rule(tmp_path):
    from fsdpcheck.formats import torchtitan
    from fsdpcheck.integrations import torchtitan as titan_integration

    root = tmp_path / "checkpoint"
    for n in (2, 10, 9):
        _dcp(root / f"step-{n}")
    (root / "step-11").mkdir()  # not finished: no .metadata
    _folder(root / "step-12", "model.safetensors.index.json")  # a save in Hugging Face format
    assert titan_integration.latest_step_folder is torchtitan.latest_step_folder
    assert torchtitan.latest_step_folder(root) == root / "step-12"
    assert torchtitan.step_folders(root) == [root / f"step-{n}" for n in (2, 9, 10, 12)]
    with pytest.raises(ValueError, match=r"with 3 step\(s\); pass one of them, e.g. .*step-10"):
        describe_path(root)
    assert torchtitan.latest_step_folder(tmp_path / "nothing") is None


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
@pytest.mark.slow
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
