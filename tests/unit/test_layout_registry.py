"""``formats.LAYOUTS``: found in the package's modules and ordered by rank, never kept by hand.

A class under ``fsdpcheck/formats/`` that is a layout (a ``CheckpointLayout`` with a name) is
picked up, not ignored: a layout that a list forgot would recognise nothing and let a less
specific one describe its checkpoints, in silence. One that cannot be placed (no rank, a rank
outside the bands, another layout's rank or name) stops ``fsdpcheck.formats`` from importing,
with both layouts named.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

import fsdpcheck.formats as formats
from fsdpcheck.formats import LAYOUTS, discover, package_modules
from fsdpcheck.formats.base import RANK_BANDS, RANK_END, CheckpointLayout

#: The order the layouts were asked in when they were a hand-kept tuple (first match wins).
#: A new layout may go anywhere between them; these keep their order.
ORDER = (
    "fsdpcheck",
    "megatron",
    "lightning",
    "torchtitan",
    "dcp",
    "deepspeed_universal",
    "deepspeed",
    "hf-trainer",
    "accelerate",
    "peft",
    "hf_storage",
    "transformers",
    "safetensors",
    "torch.save",
)


def test_the_order_of_the_layouts_is_kept():
    names = [layout.name for layout in LAYOUTS]
    assert [n for n in names if n in ORDER] == list(ORDER)


def test_ranks_rise_and_each_lies_in_a_band():
    ranks = [layout.rank for layout in LAYOUTS]
    assert all(isinstance(r, int) and RANK_BANDS[0][0] <= r < RANK_END for r in ranks)
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    assert [start for start, _ in RANK_BANDS] == sorted(start for start, _ in RANK_BANDS)


def test_every_layout_class_in_the_package_is_registered():
    def subclasses(cls: type) -> list[type]:
        return [s for c in cls.__subclasses__() for s in (c, *subclasses(c))]

    defined = {
        c
        for c in subclasses(CheckpointLayout)
        if c.__module__.startswith("fsdpcheck.formats.") and c.name
    }
    assert defined == {type(layout) for layout in LAYOUTS}
    assert len(defined) == len(ORDER)


# ---------------------------------------------------------------------------------------------
# Discovery over a package of its own, built here.
HEAD = "from fsdpcheck.formats.base import CheckpointLayout\n"


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Makes a package of layout modules under a fresh name; yields a function to import it."""
    name = f"layouts_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def build(**modules: str):
        for module, text in modules.items():
            (root / f"{module}.py").write_text(HEAD + textwrap.dedent(text))
        importlib.invalidate_caches()
        return discover(package_modules(importlib.import_module(name)))

    yield build
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def _layout(cls: str, name: str, rank: object) -> str:
    return f"""
    class {cls}(CheckpointLayout):
        name = {name!r}
        rank = {rank!r}
    """


def test_a_new_module_is_picked_up_at_its_rank(package):
    found = package(
        a=_layout("Specific", "specific", 310) + _layout("Plain", "plain", 510),
        b=_layout("Middle", "middle", 350),
        c="class Shared(CheckpointLayout):\n    pass\n",  # no name: a base, not a layout
        d="from fsdpcheck.formats.dcp import Dcp\n",  # imported: counted where defined
    )
    assert [(x.name, x.rank) for x in found] == [("specific", 310), ("middle", 350), ("plain", 510)]


def test_a_layout_without_a_rank_stops_the_import(package):
    with pytest.raises(TypeError, match=r"layout 'new' \(.*\.a\.New\) has rank None: .*band"):
        package(a="class New(CheckpointLayout):\n    name = 'new'\n")


@pytest.mark.parametrize("rank", [0, 99, RANK_END, "310", 310.0])
def test_a_rank_outside_the_bands_stops_the_import(package, rank):
    with pytest.raises(TypeError, match=r"layout 'new' .* has rank"):
        package(a=_layout("New", "new", rank))


def test_two_layouts_of_one_rank_stop_the_import_naming_both(package):
    with pytest.raises(TypeError, match=r"layout 'two' \(.*b\.Two\) has the rank 320 of layout "
                       r"'one' \(.*a\.One\): which of them is asked first"):  # fmt: skip
        package(a=_layout("One", "one", 320), b=_layout("Two", "two", 320))


def test_two_layouts_of_one_name_stop_the_import(package):
    with pytest.raises(TypeError, match=r"layout 'dcp' \(.*b\.Again\) has the name of layout"):
        package(a=_layout("First", "dcp", 200), b=_layout("Again", "dcp", 210))


def test_the_package_finds_its_own_modules_only(package):
    """A module of another package, imported into one of ours, adds nothing."""
    found = package(a="from fsdpcheck.formats.files import Safetensors, TorchSave\n")
    assert found == ()
    assert {m.__name__ for m in package_modules(formats)} >= {
        f"fsdpcheck.formats.{type(layout).__module__.rpartition('.')[2]}" for layout in LAYOUTS
    }


# ---------------------------------------------------------------------------------------------
# Paths two layouts could claim: the one its rank puts first describes them (the reasons the
# layout modules give beside their ranks).
OVERLAPS = {
    "a torchtitan step folder fsdpcheck.save wrote": (
        "step-3", [".metadata", "fsdpcheck_manifest.json"], "fsdpcheck"),
    "a universal folder holds DeepSpeed's model states": (
        "u", ["mp_rank_00_model_states.pt", "zero/x/fp32.pt"], "deepspeed_universal"),
    "a Trainer folder under DeepSpeed holds its latest file": (
        "checkpoint-2", ["trainer_state.json", "latest", "global_step2/mp_rank_00_model_states.pt",
                         "model.safetensors"], "deepspeed"),
    "a Trainer folder under FSDP holds accelerate's names": (
        "checkpoint-4", ["trainer_state.json", "pytorch_model_fsdp_0/", "optimizer_0/"],
        "hf-trainer"),
    "a Trainer folder of a PEFT model holds its adapter": (
        "checkpoint-5", ["trainer_state.json", "adapter_config.json",
                         "adapter_model.safetensors"], "hf-trainer"),
    "a folder of shards is a folder of safetensors": (
        "hs", ["shard-1-model-1-of-1.safetensors"], "hf_storage"),
    "a .ckpt is a torch.save suffix": ("lf", ["last.ckpt"], "lightning"),
    "a folder with both kinds of weights": (
        "both", ["a.safetensors", "pytorch_model.bin.index.json"], "safetensors"),
}  # fmt: skip


def _build(root: Path, names: list[str]) -> None:
    for name in names:
        q = root / name.rstrip("/")
        q.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):  # a DCP folder
            q.mkdir()
            (q / ".metadata").write_bytes(b"x")
        else:
            q.write_text("global_step2" if name == "latest" else "{}")


@pytest.mark.parametrize("case", sorted(OVERLAPS))
def test_where_two_layouts_could_claim_a_path_the_earlier_rank_does(tmp_path, case):
    folder, names, layout = OVERLAPS[case]
    root = tmp_path / folder
    root.mkdir()
    _build(root, names)
    given = root / names[0] if layout == "lightning" else root
    assert formats.describe_path(given).layout == layout


def test_a_consolidated_folder_is_described_through_its_index(tmp_path):
    """``Probe.describe``: hf_storage reads its consolidated folder as describe_path reads the
    index, with a note on the shards beside it."""
    root = tmp_path / "c"
    root.mkdir()
    _build(root, ["sharded/shard-1-model-1-of-1.safetensors", "model.safetensors.index.json"])
    info = formats.describe_path(root)
    assert info.layout == "safetensors" and info.path == root
    assert [Path(p).name for p in info.paths] == ["model.safetensors.index.json"]
    assert any(n.startswith("sharded/ holds the per-rank shards") for n in info.notes)
