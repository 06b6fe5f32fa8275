"""The embedded demo: a sharded training job saves, reloads on another mesh, and is checked.

``fsdpcheck demo`` spawns N >= 2 ranks (gloo on CPU by default; with ``--device cuda`` NCCL when
every rank has its own GPU, else the ranks share the GPUs over gloo), trains a small transformer
whose sizes do not divide evenly with FSDP2 (neighbouring shards differ in size, some are empty),
saves it with ``fsdpcheck.save``, reloads it into a fresh model on a 2 x N/2 FSDP+TP mesh (N x 1
for odd N), verifies model and optimizer (against the manifest and against the files), then
plants the classic failures one at a time (``fsdpcheck.testing``) and shows each one caught with
its key, global index and rank. It prints a table and exits 0 only when every outcome is as
expected.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.testing import (
    HIDDEN,
    VOCAB,
    build,
    drop_step,
    full_state,
    mesh_2d,
    plant,
    shift_shard,
    swap_shards,
    train,
    zero_moment,
)


@dataclass
class Outcome:
    """One row of the demo's table."""

    scenario: str
    expected: str
    found: str
    ok: bool
    seconds: float


def _describe(report: Any) -> str:
    if report.ok:
        return "pass"
    parts = []
    for f in report.findings[:2]:
        if f.kind == "value" and f.max_abs_index is not None:
            parts.append(f"{f.key}: {f.mismatched}/{f.numel} at {f.max_abs_index} on rank {f.rank}")
        else:
            parts.append(f"{f.key}: {f.kind}")
    more = len(report.findings) - 2
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _rank_main(rank: int, world: int, port: int, device: str, out: str) -> None:
    import torch.distributed as dist

    from fsdpcheck._spawn import die_with_parent

    die_with_parent()
    # torch may make its compile cache folder (under the temporary directory) as a side effect:
    # in the demo's own folder, it goes with it.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out, "inductor"))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # NCCL needs a GPU per rank; ranks sharing a GPU talk over gloo.
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    outcomes = run_rank(Path(out), device)
    if rank == 0:
        Path(out, "outcomes.json").write_text(json.dumps([asdict(o) for o in outcomes]))
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"done_{rank}").touch()


def run_rank(work: Path, device: str = "cpu") -> list[Outcome]:
    """The demo's rows on this rank, in an initialised default process group (every rank calls it).

    Args:
        work: An empty directory every rank sees (the checkpoints are written there).
        device: "cpu" or "cuda" (the current device of this rank).

    Returns:
        The outcomes, identical on every rank except for their times.
    """
    import torch.distributed as dist

    # From the modules that define them (the package's __init__ sits above every module).
    from fsdpcheck.errors import CheckpointKindError
    from fsdpcheck.fingerprints import fingerprint
    from fsdpcheck.loading import load
    from fsdpcheck.saving import save
    from fsdpcheck.verification import verify

    rank, world = dist.get_rank(), dist.get_world_size()
    outcomes: list[Outcome] = []
    ck = work / "ckpt"

    def row(name: str, expected: str, fn: Callable[[], tuple[str, bool]]) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        try:
            found, ok = fn()
        except Exception as exc:
            found, ok = f"crashed: {type(exc).__name__}: {exc}"[:160], False
            if rank == 0:
                traceback.print_exc()
        outcomes.append(Outcome(name, expected, found, ok, time.perf_counter() - t0))

    # Train with FSDP2 on all ranks, save with a manifest.
    model, opt = build("fsdp", world, device=device)
    train(model, opt, vocab=VOCAB)
    save(model, ck, optimizer=opt)
    # Reload into a fresh model on a 2D FSDP+TP mesh.
    m2, o2 = build("2d", world, seed=1, device=device)
    train(m2, o2, steps=1, vocab=VOCAB)
    dp, tp = mesh_2d(world)
    mesh = f"{dp}x{tp} FSDP+TP"

    def reload_fp() -> tuple[str, bool]:
        r = load(m2, ck, optimizer=o2, verify="fingerprint", expect="sharded")
        return f"{_describe(r)} ({r.keys_checked} keys by fingerprint)", r.ok

    def verify_full() -> tuple[str, bool]:
        r = verify(m2, ck, optimizer=o2)
        return f"{_describe(r)} ({r.elements_checked:,} elements)", r.ok

    def same_fps() -> tuple[str, bool]:
        a = fingerprint(model, optimizer=opt)
        b = fingerprint(m2, optimizer=o2)
        n = sum(a[k] == b[k] for k in a)
        return f"{n}/{len(a)} equal", a == b

    row(f"save FSDP2 x{world}, reload on {mesh}", "pass (fingerprint)", reload_fp)
    row("verify model + optimizer vs files", "pass", verify_full)
    row("fingerprints, 1D vs 2D layout", "all equal", same_fps)

    def caught(fault: Any, key: str, on_ranks: set[int]) -> Callable[[], tuple[str, bool]]:
        """Verifies with `fault` planted: exactly `key` is found, on `on_ranks` only."""

        def fn() -> tuple[str, bool]:
            with fault:
                r = verify(model, ck, optimizer=opt)
            ranks = {f.rank for f in r.findings} | {
                f.rel_rank for f in r.findings if f.rel_rank is not None
            }
            return _describe(r), {f.key for f in r.findings} == {key} and ranks <= on_ranks

        return fn

    w1 = model.get_parameter("blocks.1.w1.weight")
    on = min(3, world - 1)
    row_of = on * -(-HIDDEN // world) + 3  # Shard(0) splits rows as torch.chunk does
    row(
        "one element changed",
        f"blocks.1.w1.weight at ({row_of}, 7) on rank {on}",
        caught(plant(w1, (3, 7), delta=0.5, on_rank=on), "blocks.1.w1.weight", {on}),
    )
    row(
        "shards of two ranks swapped",
        "emb.weight on ranks 0 and 1",
        caught(swap_shards(model.get_parameter("emb.weight")), "emb.weight", {0, 1}),
    )
    w0 = model.get_parameter("blocks.0.w1.weight")
    row(
        "shard shifted one row",
        "blocks.0.w1.weight on rank 1",
        caught(shift_shard(w0, 1, on_rank=1), "blocks.0.w1.weight", {1}),
    )
    zero_on = 2 % world
    row(
        "optimizer moment zeroed",
        f"exp_avg_sq on rank {zero_on}",
        caught(
            zero_moment(opt, w0, "exp_avg_sq", on_rank=zero_on),
            "optim.state.blocks.0.w1.weight.exp_avg_sq",
            {zero_on},
        ),
    )

    def no_step() -> tuple[str, bool]:
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # Saved while the step is missing: a checkpoint whose head.bias state has no step.
        with drop_step(opt, model.get_parameter("head.bias")):
            msd, osd = get_state_dict(model, opt)
            dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(work / "ns"))
        r = verify(model, work / "ns", optimizer=opt)
        kinds = [(f.key, f.kind) for f in r.findings]
        return _describe(r), kinds == [("optim.state.head.bias.step", "missing")]

    row("missing optimizer step", "optim.state.head.bias.step missing", no_step)

    def full_as_sharded() -> tuple[str, bool]:
        full = work / "full.pt"
        sd = full_state(model)
        if rank == 0:
            torch.save({"model": {k: v.cpu() for k, v in sd.items()}}, full)
        dist.barrier()
        try:
            load(m2, full, expect="sharded")
        except CheckpointKindError:
            return "refused before loading", True
        return "loaded!", False

    row("full checkpoint where sharded expected", "refused before loading", full_as_sharded)
    return outcomes


def run(world: int = 4, device: str = "cpu", timeout: float = 600) -> list[Outcome]:
    """Runs the demo on `world` spawned ranks; the outcomes (rank 0's table)."""
    from fsdpcheck._spawn import spawn

    problem = _unusable(world, device)
    if problem:
        raise ValueError(problem)
    with tempfile.TemporaryDirectory() as tmp:
        codes = spawn(_rank_main, world, (device, tmp), timeout)
        missing = [r for r in range(world) if not Path(tmp, f"done_{r}").exists()]
        if missing or not Path(tmp, "outcomes.json").exists():
            raise RuntimeError(f"demo ranks {missing} did not finish (exit codes {codes})")
        rows = json.loads(Path(tmp, "outcomes.json").read_text())
    return [Outcome(**r) for r in rows]


def _unusable(world: int, device: str) -> str | None:
    """Why the demo cannot run with these settings (one line), or None."""
    if world < 2:
        return f"the demo needs at least 2 ranks (--ranks {world}): it swaps shards between two"
    if device == "cuda" and not torch.cuda.is_available():
        return (
            "--device cuda, but torch sees no GPU here (torch.cuda.is_available() is False); "
            "run the demo without --device cuda to use CPU ranks"
        )
    return None


def summary(world: int = 4, device: str = "cpu") -> dict[str, Any]:
    """Runs the demo; its outcome as a JSON-serialisable dict (``fsdpcheck demo --json``).

    Returns:
        ``ok`` (every outcome as expected), ``exit_code`` (0 or 1), ``ranks``, ``device``,
        ``backend``, ``seconds`` and ``outcomes`` (each row: scenario, expected, found, ok,
        seconds).

    Raises:
        ValueError: The demo cannot run with these settings (one line).
    """
    t0 = time.perf_counter()
    outcomes = run(world, device)
    ok = all(o.ok for o in outcomes)
    return {
        "ok": ok,
        "ranks": world,
        "device": device,
        "backend": _backend(world, device),
        "outcomes": [asdict(o) for o in outcomes],
        "seconds": time.perf_counter() - t0,
        "exit_code": 0 if ok else 1,
    }


def _backend(world: int, device: str) -> str:
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= world else "gloo"


def main(world: int = 4, device: str = "cpu") -> int:
    """Runs the demo, prints the table.

    Returns:
        0 when every outcome is as expected, 1 when one is not, 2 when the demo cannot run here
        (fewer than 2 ranks, or ``device="cuda"`` without a GPU), after one line on stderr.
    """
    problem = _unusable(world, device)
    if problem:
        print(f"fsdpcheck demo: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    backend = _backend(world, device)
    print(
        f"fsdpcheck demo: {world} ranks ({device}, {backend}). A small transformer (uneven and "
        "empty shards) trained with FSDP2 + AdamW, saved, reloaded on a 2D mesh, checked; then "
        "each classic failure planted and caught.",
        flush=True,
    )
    outcomes = run(world, device)
    w = [max(len(getattr(o, f)) for o in outcomes) for f in ("scenario", "expected")]
    found_w = min(90, max(len(o.found) for o in outcomes))
    print(f"\n{'scenario':{w[0]}s}  {'expected':{w[1]}s}  {'found':{found_w}s}  {'time':>6s}")
    for o in outcomes:
        mark = "ok" if o.ok else "UNEXPECTED"
        found = o.found if len(o.found) <= 90 else o.found[:87] + "..."
        print(
            f"{o.scenario:{w[0]}s}  {o.expected:{w[1]}s}  {found:{found_w}s}  "
            f"{o.seconds:5.2f}s  {mark}"
        )
    failed = sum(not o.ok for o in outcomes)
    print(
        f"\n{len(outcomes) - failed}/{len(outcomes)} outcomes as expected "
        f"({time.perf_counter() - t0:.1f} s in all)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
