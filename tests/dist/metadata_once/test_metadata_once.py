"""``.metadata`` read and checked once per job, its parse reused, pieces cut by bisection.

Multi-rank (tests/dist/metadata_once/metadata_once_scenarios.py, W = 2 and 4, a checkpoint saved by
4 ranks): per verify or load, ``.metadata`` is parsed once on every rank and checked on rank 0
alone, the other ranks trusting its digest; a rank whose bytes differ checks itself and the verdict
is the same everywhere; a damaged or broken checkpoint gives every rank the same report or the same
one-line error; each local piece is cut against the chunks it meets only; a layout is worked
out once per (mesh, placements, shape). Single process: load parses once, and a key of 16,384
chunks is searched, not scanned. Exact counts, never times.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fsdpcheck
from fsdpcheck import verification
from fsdpcheck.sources.dcp import index as dcp_index
from fsdpcheck.sources.dcp import load as safe_reader
from fsdpcheck.sources.dcp.index import StorageProblems
from fsdpcheck.sources.dcp.source import DCPSource
from tests.dist.metadata_once.metadata_once_scenarios import WORLDS
from tests.dist.scale.scale_scenarios import KEYS
from tests.dist_harness import Spawns

SCENARIOS_MODULE = "tests.dist.metadata_once.metadata_once_scenarios"


def _cases(*names: str) -> list[tuple[int, str]]:
    return [(w, n) for n in names for w in WORLDS]


def _run(spawns: Spawns, case: tuple[int, str]) -> tuple[Any, list[Any]]:
    world, name = case
    agreed = spawns.result(SCENARIOS_MODULE, world, name)  # no error, every rank the same
    return agreed, spawns.per_rank(SCENARIOS_MODULE, world, name)


def _once(per_rank: list[dict], parses: int = 1) -> None:
    """Parsed `parses` times on every rank, checked on rank 0 alone, trusted by the others."""
    n = [r["rank_local"] for r in per_rank]
    assert [c["parses"] for c in n] == [parses] * len(n)
    assert [c["dcp_parses"] for c in n] == [0] * len(n)  # DCP's load unpickles nothing
    assert [c["checks"] for c in n] == [1] + [0] * (len(n) - 1)
    assert [c["trusted"] for c in n] == [0] + [1] * (len(n) - 1)


@pytest.mark.parametrize("case", _cases("verify_clean", "load_full", "load_fingerprint"))
def test_metadata_is_parsed_once_and_checked_on_one_rank(case: tuple, spawns: Spawns) -> None:
    agreed, per_rank = _run(spawns, case)
    assert agreed["ok"] and agreed["findings"] == []
    assert agreed["keys_checked"] == KEYS
    _once(per_rank)


@pytest.mark.parametrize("case", _cases("verify_clean"))
def test_a_layout_is_worked_out_once_per_mesh_placements_and_shape(
    case: tuple, spawns: Spawns
) -> None:
    _, per_rank = _run(spawns, case)
    # KEYS tensors of one shape, on one mesh, with one placement: worked out once.
    assert [r["rank_local"]["layouts"] for r in per_rank] == [1] * case[0]


@pytest.mark.parametrize("case", _cases("verify_clean", "load_full"))
def test_each_piece_is_cut_against_the_chunks_it_meets(case: tuple, spawns: Spawns) -> None:
    # Saved by 4 ranks (one row a chunk): a rank of 4 meets 1 chunk a key, a rank of 2 meets 2,
    # never the key's 4.
    world = case[0]
    _, per_rank = _run(spawns, case)
    for r in per_rank:
        assert r["rank_local"]["cuts"] == [4 // world] * KEYS


def _planted_at(world: int) -> list:
    # One element planted at local index 0 of rank 1: its global row is rank 1's first.
    row = 4 // world
    return [["p.2", "value", 1, [row, 0]]]


@pytest.mark.parametrize("case", _cases("verify_planted"))
def test_a_planted_element_is_caught_with_the_metadata_read_once(
    case: tuple, spawns: Spawns
) -> None:
    agreed, per_rank = _run(spawns, case)
    assert not agreed["ok"]
    assert [f[:4] for f in agreed["findings"]] == _planted_at(case[0])
    _once(per_rank)


@pytest.mark.parametrize("case", _cases("differs_on_one_rank"))
def test_a_rank_whose_metadata_bytes_differ_checks_itself(case: tuple, spawns: Spawns) -> None:
    agreed, per_rank = _run(spawns, case)  # the same report on every rank
    assert [f[:4] for f in agreed["findings"]] == _planted_at(case[0])
    n = [r["rank_local"] for r in per_rank]
    assert [c["parses"] for c in n] == [1] * len(n)
    assert [c["checks"] for c in n] == [1, 1] + [0] * (len(n) - 2)
    assert [c["trusted"] for c in n] == [0, 0] + [1] * (len(n) - 2)


def _everywhere_else(world: int) -> str:
    return f"(and on ranks {list(range(1, world))})"


@pytest.mark.parametrize("case", _cases("storage_damaged"))
def test_what_rank_0_found_is_every_ranks_verdict(case: tuple, spawns: Spawns) -> None:
    agreed, per_rank = _run(spawns, case)
    verified, loaded, path = agreed["verify"], agreed["load"], agreed["path"]
    # Every key has a chunk in the truncated file: each is named, job-wide (no rank).
    assert [(f[0], f[1], f[2]) for f in verified["findings"]] == sorted(
        (f"p.{i}", "error", None) for i in range(KEYS)
    )
    for f in verified["findings"]:
        assert re.fullmatch(
            r"its data ends at byte \d+ of __1_0.distcp but the file has 10 bytes \(truncated\?\)",
            f[4],
        ), f[4]
    first = verified["findings"][0][4]
    assert loaded["raised"] == (
        f"CheckpointError: checking {path} before loading failed on rank 0 "
        f"{_everywhere_else(case[0])}: {path}: error in model.p.0: {first} (and {KEYS - 1} "
        "more); refusing to load it: nothing was loaded (fsdpcheck audit lists every problem)"
    )
    _once([r["verify"] for r in per_rank])
    _once([r["load"] for r in per_rank])


@pytest.mark.parametrize("case", _cases("metadata_broken"))
def test_a_broken_metadata_is_one_error_on_every_rank(case: tuple, spawns: Spawns) -> None:
    agreed, per_rank = _run(spawns, case)  # the same on every rank, and no rank waited
    verified, loaded, path = agreed["verify"], agreed["load"], agreed["path"]
    broken = f"DCP metadata {path}/.metadata is unreadable: pickle data was truncated"
    others = _everywhere_else(case[0])
    # Every rank's verdict (rank 0 read it for all): one finding, no rank named.
    assert verified["findings"] == [["*", "error", None, [], broken]]
    assert loaded["raised"] == (
        f"CheckpointError: checking {path} before loading failed on rank 0 {others}: {broken}"
    )
    for r in per_rank:
        for n in (r["verify"]["rank_local"], r["load"]["rank_local"]):
            # Rank 0 alone reads it; the others learn its error from the broadcast.
            assert n["parses"] == (1 if r is per_rank[0] else 0)
            assert n["checks"] == 0


# -------------------------------------------------------------------------------------------
class _Counts:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = {"parses": 0, "dcp_parses": 0, "checks": 0}
        for owner, name, what in (
            (dcp_index, "read_parsed", "parses"),
            (safe_reader, "read_dcp_metadata", "dcp_parses"),
            (dcp_index, "check", "checks"),
        ):
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name), what))

    def _counted(self, fn: Any, what: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.n[what] += 1
            return fn(*args, **kwargs)

        return wrapper


@pytest.mark.parametrize("verify", ["full", "fingerprint", None])
def test_load_parses_the_metadata_once(
    verify: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    fsdpcheck.save(model, tmp_path / "ck", optimizer=opt)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    counts = _Counts(monkeypatch)
    report = fsdpcheck.load(fresh, tmp_path / "ck", optimizer=fresh_opt, verify=verify)
    assert report.ok, report.findings
    assert counts.n == {"parses": 1, "dcp_parses": 0, "checks": 1}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fsdpcheck.verify(fresh, tmp_path / "ck", optimizer=fresh_opt).ok


RANKS = 16_384


def _many_chunks(root: Path) -> Path:
    """A DCP directory of one [16384, 2] float tensor saved as 16,384 row chunks (sparse data)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = root / "many"
    path.mkdir()
    chunks, storage = [], {}
    for r in range(RANKS):
        off = torch.Size([r, 0])
        chunks.append(ChunkStorageMetadata(off, torch.Size([1, 2])))
        storage[MetadataIndex("w", off)] = _StorageInfo("__0_0.distcp", r * 2048, 2048)
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), torch.Size([RANKS, 2]), chunks
            )
        },
        planner_data={"w": ("w",)},
        storage_data=storage,
    )
    with open(path / "__0_0.distcp", "wb") as f:
        f.truncate(RANKS * 2048)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


def test_a_piece_meets_the_few_chunks_of_a_key_saved_by_16384_ranks(tmp_path: Path) -> None:
    src = DCPSource(_many_chunks(tmp_path))
    try:
        assert src.chunk_count("w") == RANKS and src.problems() == []
        # A rank of a 4,096-rank job holds 4 rows: it meets 4 chunks, found by bisection.
        saved = src.chunks_overlapping("w", (8, 0), (4, 2))
        assert saved == [((r, 0), (1, 2)) for r in range(8, 12)]
        assert verification._along_chunks((8, 0), (4, 2), saved) == saved
        assert src.chunks_overlapping("w", (8, 1), (1, 1)) == [((8, 0), (1, 2))]
    finally:
        src.close()


def test_a_trusted_digest_takes_the_checking_process_verdict(tmp_path: Path) -> None:
    path = _many_chunks(tmp_path)
    checked = DCPSource(path)
    found = StorageProblems(findings=[("w", "gap", "a gap (as the checking process found)")])
    trusted = DCPSource(path, trusted_digest=checked.metadata_digest, trusted_check=found)
    other = DCPSource(path, trusted_digest="0" * 64, trusted_check=found)
    try:
        assert checked.validated and not trusted.validated and other.validated
        assert trusted.problems() == [("w", "gap", "a gap (as the checking process found)")]
        assert other.problems() == [] == checked.problems()  # a digest not its own: checked
    finally:
        for s in (checked, trusted, other):
            s.close()
