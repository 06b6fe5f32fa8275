"""fsdpcheck at scale: collectives and bytes per rank as the world grows; per-key costs.

Three parts, in one run:

1. Counted, on gloo CPU ranks (W = 2, 4, 8) holding an FSDP2 model of K small tensors: every
   entry point runs with every torch.distributed collective counted
   (``fsdpcheck.testing.collectives``): calls, and bytes received per rank (the largest over the
   ranks). fsdpcheck's own collectives are shown apart from DCP's: DCP's planner gathers every
   rank's plan to its coordinator and scatters the result back (torch's protocol, which grows
   with W x K on the coordinator; not fsdpcheck's to change). Fitted per entry point:
   bytes = a + b*K + c*W + d*W*K.
2. Simulated: one process runs the same code (the agreement on keys, ``combine``,
   ``gather_findings``; and ``fingerprint_report`` end to end) with a stand-in Comm whose
   collectives return what W identical ranks would, counting the bytes a rank receives; W up to
   16,384, K up to 20,000: bytes, Python seconds and peak Python memory per rank, and the
   extrapolation to 4096 ranks x 20k keys.
3. Per-key costs, one process: ``verify`` and ``compare_checkpoints`` of a DCP checkpoint of
   many small tensors (50k with --full) against a bare ``dcp.load`` of the same state;
   ``fingerprint`` of an FSDP2 (DTensor) model of many small tensors against the same plain
   model, per key.

Sizes (times on the 2-core development machine):
    --quick   W = 2, 4;    K = 100, 1000;  5k keys for part 3                    (~3 min)
    default   W = 2, 4, 8; K = 100, 1000;  20k keys for part 3                   (~8 min)
    --full    W = 2, 4, 8; K = 1000, 10000; 50k keys for part 3 (docs/scale.md's)   (~31 min)

Examples:
    python bench/bench_scale.py --quick
    python bench/bench_scale.py --full --json scale.json
    python bench/bench_scale.py --parts sim,keys
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck._spawn import spawn

# The torchtitan parts the tests use (tests/torchtitan_parts.py), from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Every tensor of the bench models: 8 rows (one per rank at W = 8), 4 columns of fp32.
SHAPE = (8, 4)
# Entry points run on a planted fault (their report must not be ok).
FAULTS = ("check_replicas, 1 differs",)


def many_tensors(keys: int, seed: int = 0) -> torch.nn.Module:
    """A model of `keys` small parameters (``p.0`` ... ``p.<keys-1>``), their sum as output."""

    class Many(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.p = torch.nn.ParameterDict(
                {str(i): torch.nn.Parameter(torch.randn(SHAPE)) for i in range(keys)}
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.stack([v.sum() for v in self.p.values()]).sum()

    return Many()


# -------------------------------------------------------------------------------------------
# Part 1: counted collectives on gloo ranks.
def _counted_rank(rank: int, world: int, port: int, keys: int, workdir: str, titan: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import fsdpcheck
    from fsdpcheck.saving import write_checkpoint_manifest
    from fsdpcheck.testing import plant
    from fsdpcheck.testing.collectives import count_collectives

    root = Path(workdir)
    model = many_tensors(keys)
    fully_shard(model)
    results: dict[str, Any] = {}

    def entry(name: str, fn: Callable[[], Any]) -> Any:
        dist.barrier()
        gc.collect()
        with count_collectives() as counts:
            t0 = time.perf_counter()
            value = fn()
            seconds = time.perf_counter() - t0
        results[name] = {"counts": counts.to_dict(), "s": seconds}
        ok = getattr(value, "ok", None)
        if ok is not None:  # as it should be: clean, but for the one planted fault
            results[name]["ok"] = ok == (name not in FAULTS)
        return value

    ck = root / "ckpt"
    entry("save", lambda: fsdpcheck.save(model, ck))
    entry("verify", lambda: fsdpcheck.verify(model, ck))
    entry("fingerprint", lambda: fsdpcheck.fingerprint(model))
    entry("check_replicas", lambda: fsdpcheck.check_replicas(model))
    # A plain copy on every rank, one element changed on rank 1: the ranks holding each version
    # of that key are looked up (a gather of 2 words per rank: the O(W) part).
    replicas = many_tensors(keys)
    with plant(replicas.get_parameter("p.0"), 0, on_rank=1):
        entry("check_replicas, 1 differs", lambda: fsdpcheck.check_replicas(replicas))
    watch = fsdpcheck.ReplicaWatch(model, every=1)
    entry("ReplicaWatch.step", watch.step)
    entry("load(verify='fingerprint')", lambda: fsdpcheck.load(model, ck, verify="fingerprint"))
    entry("load(verify='full')", lambda: fsdpcheck.load(model, ck, verify="full"))
    plain = root / "plain"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(plain))
    entry("write_checkpoint_manifest", lambda: write_checkpoint_manifest(model, plain))
    if titan:
        _torchtitan(model, root / "titan", entry)
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _torchtitan(model: torch.nn.Module, folder: Path, entry: Callable[..., Any]) -> None:
    """torchtitan's CheckpointManager with fsdpcheck's manifests: a save, a load, the check."""
    from fsdpcheck.integrations.torchtitan import save_manifests, verify_after_load
    from tests.torchtitan_parts import checkpoint_manager, optimizers

    opts, scheds = optimizers(model, lr=1e-3, training_steps=4)
    model(torch.ones(())).backward()
    opts.step()
    opts.zero_grad()
    manager = checkpoint_manager(model, opts, scheds, folder)
    save_manifests(manager)
    entry("torchtitan save + manifest", lambda: manager.save(curr_step=1))
    manager.load(step=-1)
    entry("torchtitan verify_after_load", lambda: verify_after_load(manager))
    manager.close()


def counted(worlds: list[int], keys_list: list[int], titan: bool) -> list[dict[str, Any]]:
    """Every (world, keys) run: per entry point, the largest count over the ranks."""
    rows = []
    for keys in keys_list:
        for world in worlds:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                codes = spawn(_counted_rank, world, (keys, tmp, titan), timeout=3600)
                files = [Path(tmp, f"rank{r}.json") for r in range(world)]
                missing = [r for r, f in enumerate(files) if not f.exists()]
                if missing:
                    raise SystemExit(f"W={world} K={keys}: ranks {missing} failed ({codes})")
                per_rank = [json.loads(f.read_text()) for f in files]
            for name in per_rank[0]:
                row: dict[str, Any] = {"entry": name, "world": world, "keys": keys}
                for origin in ("fsdpcheck", "dcp"):
                    got = [r[name]["counts"].get(origin, {}) for r in per_rank]
                    row[f"{origin}_bytes"] = max(g.get("bytes", 0) for g in got)
                    row[f"{origin}_calls"] = max(g.get("calls", 0) for g in got)
                    row[f"{origin}_ops"] = max(
                        (g.get("ops", {}) for g in got), key=lambda o: sum(v[1] for v in o.values())
                    )
                others = {o for r in per_rank for o in r[name]["counts"]} - {"fsdpcheck", "dcp"}
                row["other_bytes"] = max(
                    sum(r[name]["counts"].get(o, {}).get("bytes", 0) for o in others)
                    for r in per_rank
                )
                row["s"] = max(r[name]["s"] for r in per_rank)
                row["ok"] = all(r[name].get("ok", True) for r in per_rank)
                rows.append(row)
            print(
                f"# counted W={world} K={keys} in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _size(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _cell(nbytes: int, calls: int) -> str:
    text = f"{_size(nbytes)} ({calls})"
    return f"{text:>12s}"


def print_counted(rows: list[dict[str, Any]], worlds: list[int]) -> None:
    print("\n## Collectives per entry point: bytes received per rank (largest rank) and calls")
    head = " ".join(f"{'W=' + str(w):>12s}" for w in worlds)
    print(f"{'entry point':30s} {'keys':>6s} | fsdpcheck {head} | DCP {head}")
    entries = list(dict.fromkeys(r["entry"] for r in rows))
    keys_list = sorted({r["keys"] for r in rows})
    at = {(r["entry"], r["keys"], r["world"]): r for r in rows}
    for e in entries:
        for k in keys_list:
            if (e, k, worlds[0]) not in at:
                continue
            ours, theirs = [], []
            for w in worlds:
                r = at.get((e, k, w))
                if r is None:
                    ours.append(f"{'-':>12s}")
                    theirs.append(f"{'-':>12s}")
                    continue
                ours.append(_cell(r["fsdpcheck_bytes"], r["fsdpcheck_calls"]))
                theirs.append(_cell(r["dcp_bytes"], r["dcp_calls"]))
            print(f"{e:30s} {k:6d} | {'':9s} {' '.join(ours)} | {'':3s} {' '.join(theirs)}")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"# WRONG VERDICT: {[(r['entry'], r['world'], r['keys']) for r in bad]}")


def fit(points: list[tuple[int, int, float]]) -> list[float]:
    """Least squares of bytes = a + b*K + c*W + d*W*K over (W, K, bytes) points."""
    x = torch.tensor([[1.0, k, w, w * k] for w, k, _ in points], dtype=torch.float64)
    y = torch.tensor([[b] for _, _, b in points], dtype=torch.float64)
    return [float(v) for v in torch.linalg.lstsq(x, y, driver="gelsd").solution.flatten()]


def print_laws(rows: list[dict[str, Any]], at: tuple[int, int]) -> dict[str, Any]:
    w0, k0 = at
    print(
        f"\n## Growth laws (least squares over the runs): bytes per rank = a + b*K + c*W + d*W*K,"
        f" and at W={w0}, K={k0}"
    )
    print(f"{'entry point':30s} {'who':9s} {'a':>9s} {'b B/key':>9s} {'c B/rank':>9s} "
          f"{'d B/(rank*key)':>15s} {'at ' + str(w0) + 'x' + str(k0):>12s}")  # fmt: skip
    laws = {}
    for e in dict.fromkeys(r["entry"] for r in rows):
        for who in ("fsdpcheck", "dcp"):
            pts = [(r["world"], r["keys"], r[f"{who}_bytes"]) for r in rows if r["entry"] == e]
            if len({(w, k) for w, k, _ in pts}) < 4 or not any(b for _, _, b in pts):
                continue
            a, b, c, d = fit(pts)
            extra = a + b * k0 + c * w0 + d * w0 * k0
            laws[f"{e} / {who}"] = {"a": a, "b": b, "c": c, "d": d, "at": extra}
            print(f"{e:30s} {who:9s} {a:9.0f} {b:9.1f} {c:9.1f} {d:15.3f} {_size(extra):>12s}")
    return laws


# -------------------------------------------------------------------------------------------
# Part 2: a larger world simulated in one process, through the same code.
class _SimComm:
    """Stands in for ``dist.comm.Comm``: the collectives of W identical ranks, bytes counted.

    This is rank W-1 (never a broadcast's source): an all-reduce receives its tensor (SUM: W
    times it, MIN/MAX: it), an all-gather of words W copies, a broadcast the pickle of the
    object and its length.
    """

    def __init__(self, world: int) -> None:
        self.enabled = True
        self.group = None
        self.world = world
        self.rank = world - 1
        self.device = torch.device("cpu")
        self.bytes = 0
        self.calls = 0
        self.timeout = 1800.0
        self.entry = self.step = ""

    def set_group_timeout(self, seconds: float) -> None:
        return None

    def all_reduce(self, t: torch.Tensor, op: Any, step: str = "") -> torch.Tensor:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        return t * self.world if op == dist.ReduceOp.SUM else t.clone()

    def all_gather_words(self, words: list[int], step: str = "") -> list[list[int]]:
        self.calls += 1
        self.bytes += 8 * len(words) * self.world
        return [list(words) for _ in range(self.world)]

    def broadcast_object(self, obj: Any, src: int, step: str = "") -> Any:
        self.calls += 2
        self.bytes += 8 + len(pickle.dumps(obj, protocol=4))
        return pickle.loads(pickle.dumps(obj, protocol=4))


def _combining(world: int, keys: int) -> Callable[[], _SimComm]:
    """What every checking entry point does with its per-key rows once the local work is done."""
    from fsdpcheck.collectives import combine, gather_findings
    from fsdpcheck.dist.runner import Call
    from fsdpcheck.keyset import agree_keys
    from fsdpcheck.layout import Meta
    from fsdpcheck.live import LiveState
    from fsdpcheck.stats import KeyStats

    names = [f"layers.{i // 8}.p{i % 8}" for i in range(keys)]
    live = LiveState(model={n: Meta(SHAPE, "float32") for n in names})
    mesh = frozenset(range(world))  # a DTensor's mesh: one set per mesh, shared by its keys
    stats = [
        KeyStats(
            numel=32, holders=1, max_abs=0.0, max_abs_idx=0, max_rel=0.0, max_rel_idx=0,
            fp=(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1), box=0, owner=True, copy_numel=32,
            mesh_ranks=mesh,
        )
        for i in range(keys)
    ]  # fmt: skip

    def run() -> _SimComm:
        comm: Any = _SimComm(world)
        call = Call("bench", None, None)
        call.comm = comm
        agree_keys(call, live)
        combine(comm, stats)
        gather_findings(comm, [])
        return comm

    return run


def _end_to_end(world: int, keys: int) -> Callable[[], _SimComm]:
    """``fingerprint_report`` of a plain model of `keys` tensors as rank W-1 of W."""
    from unittest import mock

    from fsdpcheck.fingerprints import fingerprint_report

    state = {f"layers.{i // 8}.p{i % 8}": torch.randn(SHAPE) for i in range(keys)}

    def run() -> _SimComm:
        comm: Any = _SimComm(world)
        with mock.patch("fsdpcheck.dist.runner.Comm", lambda group=None, timeout=None: comm):
            fingerprint_report(state)
        return comm

    return run


def _measure(make: Callable[[int, int], Callable[[], _SimComm]], world: int, keys: int) -> dict:
    run = make(world, keys)
    run()  # warm: imports, caches
    gc.collect()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        comm = run()
        best = min(best, time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"bytes": comm.bytes, "calls": comm.calls, "s": best, "peak": peak}


def simulated(worlds: list[int], keys_list: list[int], e2e_worlds: list[int]) -> list[dict]:
    rows = []
    runs = (("combining", _combining, worlds), ("fingerprint", _end_to_end, e2e_worlds))
    for name, make, ws in runs:
        for keys in keys_list:
            for world in ws:
                row = {"what": name, "world": world, "keys": keys, **_measure(make, world, keys)}
                rows.append(row)
    return rows


def print_simulated(rows: list[dict[str, Any]], target: tuple[int, int]) -> dict[str, Any]:
    print(
        "\n## Simulated worlds (one process, the same code, a stand-in Comm of W identical "
        "ranks): per rank"
    )
    print(f"{'what':12s} {'W':>6s} {'keys':>6s} {'bytes':>9s} {'calls':>5s} {'Python s':>9s} "
          f"{'peak Python mem':>15s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['what']:12s} {r['world']:6d} {r['keys']:6d} {_size(r['bytes']):>9s} "
            f"{r['calls']:5d} {r['s']:9.3f} {_size(r['peak']) + 'B':>15s}"
        )
    out = {}
    w0, k0 = target
    for what in dict.fromkeys(r["what"] for r in rows):
        hit = [r for r in rows if r["what"] == what and (r["world"], r["keys"]) == (w0, k0)]
        if hit:
            out[what] = hit[0]
    return out


# -------------------------------------------------------------------------------------------
# Part 3: per-key costs in one process.
def per_key_costs(keys: int, fp_keys: int, reps: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import fsdpcheck

    torch.manual_seed(0)
    state = {f"layers.{i // 8}.p{i % 8}": torch.randn(16) for i in range(keys)}
    out: dict[str, Any] = {"keys": keys}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp, "dcp"))
        dcp.save(state, checkpoint_id=path, no_dist=True)

        def bare() -> None:
            into = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(into, checkpoint_id=path, no_dist=True)

        runs: dict[str, Callable[[], Any]] = {
            "dcp.load": bare,
            "verify": lambda: fsdpcheck.verify(state, path),
            "compare_checkpoints": lambda: fsdpcheck.compare_checkpoints(path, path),
        }
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        oks: dict[str, bool] = {}
        for _ in range(reps):  # interleaved, so that a busy moment does not favour one
            for name, fn in runs.items():
                gc.collect()
                t0, c0 = time.perf_counter(), time.process_time()
                value = fn()
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
                if value is not None:
                    oks[name] = bool(value.ok)
    out["s"] = {k: min(w for w, _ in v) for k, v in times.items()}
    out["cpu_s"] = {k: min(c for _, c in v) for k, v in times.items()}
    out["ok"] = oks
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_fingerprint_rank, 1, (fp_keys, reps, tmp))
        out["fingerprint"] = json.loads(Path(tmp, "fp.json").read_text())
    return out


def _fingerprint_rank(rank: int, world: int, port: int, keys: int, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    import fsdpcheck

    plain = many_tensors(keys)
    sharded = many_tensors(keys)
    fully_shard(sharded)
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "dtensor": []}
    same = True
    for _ in range(reps + 1):
        got = {}
        for name, model in (("plain", plain), ("dtensor", sharded)):
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            got[name] = fsdpcheck.fingerprint(model)
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
        same = same and got["plain"] == got["dtensor"]
    # The first of each warms the caches.
    result = {
        "keys": keys,
        "s": {k: min(w for w, _ in v[1:]) for k, v in times.items()},
        "cpu_s": {k: min(c for _, c in v[1:]) for k, v in times.items()},
        "same": same,
    }
    Path(out, "fp.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def print_per_key(r: dict[str, Any]) -> None:
    s, cpu = r["s"], r["cpu_s"]
    print(
        f"\n## Per-key costs, one process, {r['keys']} keys of 16 fp32 (best of the runs; wall "
        "time, and CPU time of the process: on a shared machine the steadier of the two)"
    )
    for name in ("verify", "compare_checkpoints"):
        print(
            f"{name:20s} wall {s[name]:6.2f} s = {s[name] / s['dcp.load']:.2f}x, CPU "
            f"{cpu[name]:6.2f} s = {cpu[name] / cpu['dcp.load']:.2f}x a bare dcp.load (wall "
            f"{s['dcp.load']:.2f} s, CPU {cpu['dcp.load']:.2f} s)   ok={r['ok'].get(name)}"
        )
    fp = r["fingerprint"]
    for what in ("s", "cpu_s"):
        per = {k: v / fp["keys"] * 1e6 for k, v in fp[what].items()}
        print(
            f"fingerprint of {fp['keys']} keys ({'wall' if what == 's' else 'CPU'}): FSDP2 "
            f"(DTensor) {per['dtensor']:.1f} us/key, plain {per['plain']:.1f} us/key: "
            f"{per['dtensor'] / per['plain']:.2f}x   (same fingerprints: {fp['same']})"
        )


# -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the smallest sizes (~3 min)")
    size.add_argument("--full", action="store_true", help="docs/scale.md's sizes (~31 min)")
    p.add_argument("--parts", default="counted,sim,keys", help="any of counted,sim,keys")
    p.add_argument("--no-torchtitan", action="store_true", help="leave the torchtitan rows out")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    sim_worlds, sim_keys = [2, 16, 128, 1024, 4096, 16384], [1000, 20000]
    e2e_worlds, reps = [2, 4096, 16384], 3
    worlds, keys_list, per_keys, fp_keys = [2, 4, 8], [100, 1000], 20000, 5000
    if args.quick:
        worlds, per_keys, fp_keys, reps = [2, 4], 5000, 2000, 2
        sim_worlds, e2e_worlds = [2, 64, 4096], [2, 4096]
    elif args.full:
        keys_list, per_keys, fp_keys = [1000, 10000], 50000, 10000
    target = (4096, 20000)
    titan = not args.no_torchtitan
    if titan:
        try:
            import torchtitan  # noqa: F401
        except ImportError:
            titan = False
            print("# torchtitan is not installed: its rows are left out", file=sys.stderr)
    print(f"# fsdpcheck scale bench, torch {torch.__version__}, {os.cpu_count()} CPUs")
    result: dict[str, Any] = {}
    if "counted" in parts:
        rows = counted(worlds, keys_list, titan)
        print_counted(rows, worlds)
        result["counted"] = rows
        result["laws"] = print_laws(rows, target)
        print(
            "# DCP's bytes are its planner's: every rank's plan gathered to the coordinator and "
            "the global plan scattered back (torch's protocol, not fsdpcheck's)."
        )
    if "sim" in parts:
        rows = simulated(sim_worlds, sim_keys, e2e_worlds)
        result["simulated"] = rows
        at = print_simulated(rows, target)
        w0, k0 = target
        print(f"\n## Extrapolation to {w0} ranks x {k0} keys, per rank and per call")
        for what, r in at.items():
            print(
                f"{what:12s}: {_size(r['bytes'])}B received in {r['calls']} collectives, "
                f"{r['s']:.2f} s of Python, {_size(r['peak'])}B peak Python memory (simulated)"
            )
        for name, law in result.get("laws", {}).items():
            if name.endswith("/ fsdpcheck"):
                print(f"{name:45s}: {_size(law['at'])}B received (fitted law)")
    if "keys" in parts:
        r = per_key_costs(per_keys, fp_keys, reps)
        result["per_key"] = r
        print_per_key(r)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
