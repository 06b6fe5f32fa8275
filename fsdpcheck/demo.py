"""The embedded demo: a sharded training job saves, reloads on another mesh, and is checked.

``fsdpcheck demo`` spawns N ranks (gloo on CPU by default; with ``--device cuda`` the ranks share
the GPUs over gloo), trains a small transformer whose sizes do not divide evenly with FSDP2,
saves it with ``fsdpcheck.save``, reloads it into a fresh model on a 2 x N/2 FSDP+TP mesh,
verifies model and optimizer (against the manifest and against the files), then plants the
classic failures one at a time and shows each one caught with its key, global index and rank.
It prints a table and exits 0 only when every outcome is as expected.
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
from torch import nn

VOCAB, DIM, HIDDEN, OUT = 103, 24, 58, 5  # 103 rows over 4 ranks: 26, 26, 26, 25


class Block(nn.Module):
    """A pre-norm MLP block."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return h + self.w2(torch.relu(self.w1(self.norm(h))))


class TinyTransformer(nn.Module):
    """Embedding, MLP blocks, head; sizes chosen to give uneven (and empty) shards."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, out: int = OUT):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden), Block(dim, hidden)])
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        # A fresh tensor, not a view: FSDP2 warns that in-place ops on a returned view would skip
        # its pre-backward hook.
        return self.head(h).clone()


def build(
    layout: str, world: int, seed: int = 0, device: str = "cpu", model_cls: type = TinyTransformer
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model in a layout ("fsdp", "hsdp", "2d" (FSDP x TP), "ddp", "plain") and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = model_cls().to(device)
    if layout == "fsdp":
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    elif layout == "hsdp":
        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "2d":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout != "plain":
        raise ValueError(f"unknown layout {layout!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2, vocab: int = 7) -> None:
    """A few AdamW steps on the same data on every rank."""
    g = torch.Generator().manual_seed(123)
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randint(0, vocab, (4, 5), generator=g).to(device)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


@dataclass
class Outcome:
    """One row of the demo's table."""

    scenario: str
    expected: str
    found: str
    ok: bool
    seconds: float


def swap_shards(local: torch.Tensor, ranks: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Exchanges `local` between two ranks in place (a planted fault); the original, to restore.

    Collective for the two ranks (the others return at once).
    """
    import torch.distributed as dist

    saved = local.detach().clone()
    rank = dist.get_rank()
    if rank in ranks:
        peer = ranks[1] if rank == ranks[0] else ranks[0]
        other = torch.empty_like(saved)
        ops = [dist.P2POp(dist.isend, saved, peer), dist.P2POp(dist.irecv, other, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        with torch.no_grad():
            local.copy_(other)
    return saved


def _local(model: nn.Module, fqn: str) -> torch.Tensor:
    p = dict(model.named_parameters())[fqn]
    return p.to_local() if hasattr(p, "to_local") else p


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

    import fsdpcheck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        # NCCL needs a GPU per rank; ranks sharing a GPU talk over gloo.
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    outcomes: list[Outcome] = []
    work = Path(out)
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
    fsdpcheck.save(model, ck, optimizer=opt)
    # Reload into a fresh model on a 2 x world/2 FSDP+TP mesh.
    m2, o2 = build("2d", world, seed=1, device=device)
    train(m2, o2, steps=1, vocab=VOCAB)
    mesh = f"2x{world // 2} FSDP+TP"

    def reload_fp() -> tuple[str, bool]:
        r = fsdpcheck.load(m2, ck, optimizer=o2, verify="fingerprint", expect="sharded")
        return f"{_describe(r)} ({r.keys_checked} keys by fingerprint)", r.ok

    def verify_full() -> tuple[str, bool]:
        r = fsdpcheck.verify(m2, ck, optimizer=o2)
        return f"{_describe(r)} ({r.elements_checked:,} elements)", r.ok

    def same_fps() -> tuple[str, bool]:
        a = fsdpcheck.fingerprint(model, optimizer=opt)
        b = fsdpcheck.fingerprint(m2, optimizer=o2)
        n = sum(a[k] == b[k] for k in a)
        return f"{n}/{len(a)} equal", a == b

    row(f"save FSDP2 x{world}, reload on {mesh}", "pass (fingerprint)", reload_fp)
    row("verify model + optimizer vs files", "pass", verify_full)
    row("fingerprints, 1D vs 2D layout", "all equal", same_fps)

    def planted(fqn: str, on_rank: int, edit: Callable[[torch.Tensor], None], key: str) -> Any:
        def fn() -> tuple[str, bool]:
            local = _local(model, fqn)
            saved = local.detach().clone()
            if rank == on_rank:
                with torch.no_grad():
                    edit(local)
            r = fsdpcheck.verify(model, ck, optimizer=opt)
            with torch.no_grad():
                local.copy_(saved)
            keys = {f.key for f in r.findings}
            ranks = {f.rank for f in r.findings}
            return _describe(r), keys == {key} and ranks == {on_rank}

        return fn

    def bump(t: torch.Tensor) -> None:
        t[3, 7] += 0.5

    on = min(3, world - 1)
    row_of = on * -(-HIDDEN // world) + 3  # Shard(0) splits rows as torch.chunk does
    row(
        "one element changed",
        f"blocks.1.w1.weight at ({row_of}, 7) on rank {on}",
        planted("blocks.1.w1.weight", on, bump, "blocks.1.w1.weight"),
    )

    def swapped() -> tuple[str, bool]:
        local = _local(model, "emb.weight")
        saved = swap_shards(local)
        r = fsdpcheck.verify(model, ck)
        with torch.no_grad():
            local.copy_(saved)
        ranks = {f.rank for f in r.findings} | {f.rel_rank for f in r.findings}
        return _describe(r), {f.key for f in r.findings} == {"emb.weight"} and ranks <= {0, 1}

    row("shards of two ranks swapped", "emb.weight on ranks 0 and 1", swapped)

    def shift(t: torch.Tensor) -> None:
        t.copy_(torch.roll(t, 1, dims=0))

    row(
        "shard shifted one row",
        "blocks.0.w1.weight on rank 1",
        planted("blocks.0.w1.weight", 1, shift, "blocks.0.w1.weight"),
    )

    def zeroed() -> tuple[str, bool]:
        p = dict(model.named_parameters())["blocks.0.w1.weight"]
        moment = opt.state[p]["exp_avg_sq"]
        local = moment.to_local() if hasattr(moment, "to_local") else moment
        saved = local.clone()
        if rank == 2 % world:
            local.zero_()
        r = fsdpcheck.verify(model, ck, optimizer=opt)
        local.copy_(saved)
        key = "optim.state.blocks.0.w1.weight.exp_avg_sq"
        return _describe(r), {f.key for f in r.findings} == {key}

    row("optimizer moment zeroed", f"exp_avg_sq on rank {2 % world}", zeroed)

    def no_step() -> tuple[str, bool]:
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd_typed = get_state_dict(model, opt)
        osd: Any = osd_typed  # a nested dict of torch's ValueType
        state = dict(osd["state"])
        state["head.bias"] = {k: v for k, v in state["head.bias"].items() if k != "step"}
        dcp_save({"model": msd, "optim": {**osd, "state": state}}, checkpoint_id=str(work / "ns"))
        r = fsdpcheck.verify(model, work / "ns", optimizer=opt)
        kinds = [(f.key, f.kind) for f in r.findings]
        return _describe(r), kinds == [("optim.state.head.bias.step", "missing")]

    row("missing optimizer step", "optim.state.head.bias.step missing", no_step)

    def full_as_sharded() -> tuple[str, bool]:
        full = work / "full.pt"
        sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in
              model.state_dict().items()}  # fmt: skip
        if rank == 0:
            torch.save({"model": {k: v.cpu() for k, v in sd.items()}}, full)
        dist.barrier()
        try:
            fsdpcheck.load(m2, full, expect="sharded")
        except fsdpcheck.CheckpointKindError:
            return "refused before loading", True
        return "loaded!", False

    row("full checkpoint where sharded expected", "refused before loading", full_as_sharded)

    if rank == 0:
        Path(out, "outcomes.json").write_text(json.dumps([asdict(o) for o in outcomes]))
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"done_{rank}").touch()


def run(world: int = 4, device: str = "cpu", timeout: float = 600) -> list[Outcome]:
    """Runs the demo on `world` spawned ranks; the outcomes (rank 0's table)."""
    from fsdpcheck._spawn import spawn

    if world < 2 or world % 2:
        raise ValueError(f"the demo needs an even number of ranks >= 2, not {world}")
    with tempfile.TemporaryDirectory() as tmp:
        codes = spawn(_rank_main, world, (device, tmp), timeout)
        missing = [r for r in range(world) if not Path(tmp, f"done_{r}").exists()]
        if missing or not Path(tmp, "outcomes.json").exists():
            raise RuntimeError(f"demo ranks {missing} did not finish (exit codes {codes})")
        rows = json.loads(Path(tmp, "outcomes.json").read_text())
    return [Outcome(**r) for r in rows]


def main(world: int = 4, device: str = "cpu") -> int:
    """Runs the demo, prints the table; 0 when every outcome is as expected."""
    t0 = time.perf_counter()
    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= world else "gloo"
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
