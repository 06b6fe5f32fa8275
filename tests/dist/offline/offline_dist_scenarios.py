"""The offline commands spread over the processes of a launch, inside gloo ranks (dist_harness).

Each scenario runs the command line (``fsdpcheck.cli.main``) twice on every rank: alone (no
session: the one-process run) and inside an ``offline_dist`` session over the harness's process
group (what ``torchrun ... -m fsdpcheck`` runs after joining its group), and returns what must
be the same on every rank: exit codes, whether rank 0 printed exactly the one-process output and
the others nothing, the errors everyone raised. The setup of each world writes the checkpoints:
a model saved by ``fsdpcheck.save`` (DCP + manifest) and as safetensors, clean and with one
element planted, and a copy of the clean DCP save with one byte changed on disk.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck import offline_dist
from fsdpcheck.cli import main
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario

#: The planted element (in "planted" and "planted.safetensors") and the byte changed on disk
#: (in "rotten", the clean DCP save whose manifest no longer matches its data).
PLANTED = ("big.weight", (1500, 7))
#: A budget that cuts big.weight (196 KB, bf16) into row blocks that land on several ranks.
BUDGET = "64K"


def model() -> torch.nn.Module:
    """Tensors of several dtypes and shapes: 0-d, empty, one row, one large enough to split."""
    g = torch.Generator().manual_seed(3)
    m = torch.nn.Module()
    m.emb = torch.nn.Linear(64, 300, bias=False)
    m.big = torch.nn.Linear(48, 2048, bias=False)
    m.head = torch.nn.Linear(5, 7)
    with torch.no_grad():
        m.emb.weight.copy_(torch.randn(300, 64, generator=g))
        m.big.weight.copy_(torch.randn(2048, 48, generator=g))
        m.head.weight.copy_(torch.randn(7, 5, generator=g))
        m.head.bias.copy_(torch.randn(7, generator=g))
    m.big.to(torch.bfloat16)
    m.empty = torch.nn.Parameter(torch.zeros(0, 4))
    m.register_buffer("scale", torch.tensor(0.5))
    m.register_buffer("steps", torch.arange(3, dtype=torch.int64))
    return m


def build(root: Path, rank: int = 0) -> dict[str, Path]:
    """The checkpoints (every rank of the current group calls it: fsdpcheck.save is collective)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    group = dist.is_available() and dist.is_initialized()
    paths = {
        "clean": root / "clean",
        "planted": root / "planted",
        "rotten": root / "rotten",
        "clean.safetensors": root / "clean.safetensors",
        "planted.safetensors": root / "planted.safetensors",
    }
    m = model()
    fsdpcheck.save(m, paths["clean"])
    if rank == 0:
        save_file(dict(m.state_dict()), str(paths["clean.safetensors"]))
    with torch.no_grad():
        m.get_parameter(PLANTED[0])[PLANTED[1]] += 1.0
    fsdpcheck.save(m, paths["planted"])
    if rank == 0:
        save_file(dict(m.state_dict()), str(paths["planted.safetensors"]))
        shutil.copytree(paths["clean"], paths["rotten"])
        _rot(paths["rotten"])
    if group:
        dist.barrier()
    return paths


def _rot(path: Path) -> None:
    """Changes the planted element's bytes in a DCP save (the manifest keeps the old ones)."""
    from fsdpcheck.testing.faults import find_bytes

    clean = model().get_parameter(PLANTED[0]).detach()
    row, col = PLANTED[1]
    for data in sorted(path.glob("*.distcp")):
        try:
            at = find_bytes(data, clean) + (row * clean.shape[1] + col) * clean.element_size()
        except ValueError:
            continue  # saved in another file
        raw = bytearray(data.read_bytes())
        raw[at + 1] ^= 0x40  # the high byte of a bf16: the value changes, not only its last bit
        data.write_bytes(bytes(raw))
        return
    raise AssertionError(f"{PLANTED[0]} is in no data file of {path}")


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, None]:
    del world, saved_by  # each world writes its own (small) checkpoints
    return build(shared, rank), None


REGISTRY.setup = setup


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


# -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def alone() -> Iterator[None]:
    """A one-process run: without torchrun's variables (another registry may have set them)."""
    saved = {k: os.environ.pop(k) for k in offline_dist.LAUNCH_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def everyone(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (the same list on every rank)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def cli(argv: list[str], session: Any = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command line (spread over `session` when given)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv, session=session)
    return code, out.getvalue(), err.getvalue()


def without_seconds(text: str) -> Any:
    data = json.loads(text)
    if isinstance(data, dict):
        data.pop("seconds", None)
    return data


def commands(c: dict[str, Path]) -> dict[str, list[str]]:
    """The runs compared with their one-process twins, by name."""
    s = {k: str(v) for k, v in c.items()}
    budget = ["--memory-budget", BUDGET, "--json"]
    return {
        "compare_dcp_clean": ["compare", s["clean"], s["clean.safetensors"], *budget],
        "compare_dcp_planted": ["compare", s["planted"], s["clean.safetensors"], *budget],
        "compare_st_planted": [
            "compare",
            s["clean.safetensors"],
            s["planted.safetensors"],
            *budget,
        ],
        "compare_dcp_dcp_planted": ["compare", s["clean"], s["planted"], *budget],
        "fingerprint_dcp": ["fingerprint", s["planted"], *budget],
        "fingerprint_st": ["fingerprint", s["planted.safetensors"], *budget],
        "audit_clean": ["audit", "--deep", s["clean"], "--json"],
        "audit_rotten": ["audit", "--deep", s["rotten"], "--json"],
    }


@scenario(2, 4)
def spread_runs_equal_one_process(w: World) -> Any:
    """Every command: the same JSON (but seconds) and exit code as one process; rank 0 speaks.

    Returns per command: the one-process report, and per rank its exit code alone and spread,
    and what it printed spread: rank 0 the one-process report (True when equal), the others
    nothing ("" on stdout and stderr).
    """
    out: dict[str, Any] = {}
    for name, argv in commands(w.ckpts).items():
        with alone():
            code1, text1, _ = cli(argv)
        with offline_dist.session() as s:
            code, text, err = cli(argv, s)
        if w.rank == 0:
            said = without_seconds(text) == without_seconds(text1) if text else text
        else:
            said = text
        out[name] = {
            "report": without_seconds(text1),
            "ranks": everyone({"codes": [code1, code], "stdout": said, "stderr": err}),
        }
    return out


def failing_reads(rank: int) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A fault: every checkpoint read on `rank` fails as a disk would (EIO, naming its file)."""
    from fsdpcheck.sources import prefetch

    @contextlib.contextmanager
    def fault() -> Iterator[None]:
        if torch.distributed.get_rank() != rank:
            yield
            return
        real = prefetch._read

        def broken(source: Any, regions: Any, *args: Any) -> Any:
            raise OSError(errno.EIO, os.strerror(errno.EIO), f"{source.description} (data)")

        prefetch._read = broken
        try:
            yield
        finally:
            prefetch._read = real

    return fault


def errors(w: World, argv: list[str], fault: Callable[[], Any]) -> list[dict[str, Any]]:
    """The command with `fault`: alone, spread, and the API's exception spread; per rank."""
    from fsdpcheck.cli import _one_line

    with fault():
        with alone():
            code1, _, err1 = cli(argv)
        with offline_dist.session() as s:
            code, text, err = cli(argv, s)
            api = None
            try:
                s.agreed(lambda: fsdpcheck.fingerprint_checkpoint(argv[1], session=s), _one_line)
            except Exception as exc:
                api = f"{type(exc).__name__}: {exc}"
    return everyone(
        {
            "alone": [code1, err1.strip()],
            "spread": [code, text, err.strip()],
            "api": api,
        }
    )


@scenario(2, 4)
def read_failure_on_the_last_rank(w: World) -> Any:
    """Reads fail on the last rank only: everyone says its error, exits 2, nobody hangs."""
    argv = ["fingerprint", str(w.ckpts["clean"]), "--memory-budget", BUDGET]
    return errors(w, argv, failing_reads(w.size - 1))


@scenario(2)
def open_fails_on_one_rank(w: World) -> Any:
    """Rank 1 cannot open the checkpoint (before any collective): the same error everywhere."""
    from fsdpcheck import fingerprints

    @contextlib.contextmanager
    def fault() -> Iterator[None]:
        real = fingerprints.open_source

        def missing(path: Any) -> Any:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))

        if w.rank == 1:
            fingerprints.open_source = missing  # type: ignore[assignment]
        try:
            yield
        finally:
            fingerprints.open_source = real

    return errors(w, ["fingerprint", str(w.ckpts["clean"])], fault)


@scenario(2)
def ranks_see_different_checkpoints(w: World) -> Any:
    """The same path, other files on rank 1 (a filesystem out of sync): refused, not mixed."""
    from fsdpcheck import comparison

    real = comparison.open_source
    other = w.workdir / "other"
    if w.rank == 0:
        shutil.copytree(w.ckpts["clean"], other)
    w.barrier()

    def elsewhere(path: Any) -> Any:
        if str(path) == str(w.ckpts["clean"]):
            return real(w.ckpts["clean.safetensors"])  # the same model, another key set
        return real(path)

    if w.rank == 1:
        comparison.open_source = elsewhere  # type: ignore[assignment]
    try:
        with offline_dist.session() as s:
            code, _, err = cli(["compare", str(w.ckpts["clean"]), str(other)], s)
    finally:
        comparison.open_source = real
    return everyone([code, err.strip()])


@contextlib.contextmanager
def counted() -> Iterator[dict[str, int]]:
    """Bytes this rank receives through torch.distributed's collectives, while inside."""
    import torch.distributed as dist

    got = {"bytes": 0, "calls": 0}

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def all_reduce(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        got["bytes"] += size(t)
        got["calls"] += 1
        return real["all_reduce"](t, *a, **k)

    def all_gather(outs: list[torch.Tensor], t: torch.Tensor, *a: Any, **k: Any) -> Any:
        got["bytes"] += sum(size(o) for o in outs)
        got["calls"] += 1
        return real["all_gather"](outs, t, *a, **k)

    def broadcast(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        got["bytes"] += size(t)
        got["calls"] += 1
        return real["broadcast"](t, *a, **k)

    names = {"all_reduce": all_reduce, "all_gather": all_gather, "broadcast": broadcast}
    real = {n: getattr(dist, n) for n in names}
    for n, fn in names.items():
        setattr(dist, n, fn)
    try:
        yield got
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)


@scenario(2, 4)
def bytes_per_rank_and_shares(w: World) -> Any:
    """Bytes received per rank (they must not grow with the world), and bytes each rank read."""
    from fsdpcheck.sources import prefetch

    read = {"bytes": 0}
    real = prefetch._read

    def reading(source: Any, regions: Any, *args: Any) -> Any:
        read["bytes"] += sum(r.numel * source.entries()[r.key].dtype.itemsize for r in regions)
        return real(source, regions, *args)

    out: dict[str, Any] = {"received": {}, "read": {}}
    prefetch._read = reading
    try:
        for name, argv in commands(w.ckpts).items():
            if name not in ("compare_dcp_planted", "fingerprint_dcp", "audit_rotten"):
                continue
            read["bytes"] = 0
            with offline_dist.session() as s, counted() as got:
                cli(argv, s)
            out["received"][name] = everyone(got)
            out["read"][name] = everyone(read["bytes"])
        with alone():
            for name in ("compare_dcp_planted", "fingerprint_dcp", "audit_rotten"):
                read["bytes"] = 0
                cli(commands(w.ckpts)[name])
                out["read"][name + "_alone"] = read["bytes"]
    finally:
        prefetch._read = real
    return out
