"""Live-model checks of the multi-rank corpus, in one launch; results as JSON for pytest.

Usage: torchrun --nproc-per-node 2 -m tests.corpus.check_dist CORPUS_DIR

For every case with a live model: rebuild the library's trained state (deterministic, same as
when it was saved), then ``verify`` it against the clean and the planted checkpoint and
``fingerprint`` it, fingerprinting the model and optimizer before and after each call; then
``verify`` with a fresh optimizer that has NO state. Each rank writes
``CORPUS_DIR/check_<rank>.json``: case name -> what each call returned (or raised).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.corpus import changed, read_cases, resolve, snapshot
from tests.corpus.live import adamw


def report_dict(r: Any) -> dict[str, Any]:
    """What the tests need from a Report (attributes of the contract read defensively)."""
    mapping = getattr(r, "mapping", None) or []
    return {
        "ok": bool(r.ok),
        "findings": [
            [f.key, f.kind, list(f.max_abs_index) if f.max_abs_index is not None else None]
            for f in r.findings
        ],
        "keys_a": getattr(r, "keys_a", None),
        "keys_b": getattr(r, "keys_b", None),
        "keys_checked": r.keys_checked,
        "mapping": [[m.a, m.b, m.status] for m in mapping],
        "notes": list(r.notes),
        "summary": r.summary(),
        "text": str(r),
    }


def guarded(fn: Any) -> dict[str, Any]:
    """``fn()``'s result, or the exception as text (a failing call must not stop the others)."""
    try:
        return {"result": fn()}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def check(live: Any, case: Any) -> dict[str, Any]:
    """The read-only-guarded calls for one case."""
    import fsdpcheck

    out: dict[str, Any] = {}
    calls = {
        "verify": lambda: report_dict(
            fsdpcheck.verify(live.model, case.path, optimizer=live.optimizer)
        ),
        "verify_planted": lambda: report_dict(
            fsdpcheck.verify(live.model, case.planted_path, optimizer=live.optimizer)
        ),
        "fingerprint": lambda: {
            k: f"{v:016x}"
            for k, v in fsdpcheck.fingerprint(live.model, optimizer=live.optimizer).items()
        },
    }
    for name, fn in calls.items():
        dist.barrier()
        before = snapshot(live.inner, live.optimizer)
        out[name] = guarded(fn)
        out[name]["changed"] = changed(before, snapshot(live.inner, live.optimizer))
    # An optimizer that never stepped: torch's get_optimizer_state_dict would initialise its
    # state by running a step (changing the weights); verify must report it and change nothing.
    fresh = adamw(live.inner.parameters())
    dist.barrier()
    before = snapshot(live.inner, fresh)
    out["verify_no_state"] = guarded(
        lambda: report_dict(fsdpcheck.verify(live.model, case.path, optimizer=fresh))
    )
    out["verify_no_state"]["changed"] = changed(before, snapshot(live.inner, fresh))
    return out


def main() -> None:
    root = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = read_cases(root / "cases.json")
    lives: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for case in cases.values():
        if case.skip or not case.make_live:
            continue
        try:
            if case.make_live not in lives:  # one trained state serves every save of it
                lives[case.make_live] = resolve(case.make_live)(rank, world)
            results[case.name] = check(lives[case.make_live], case)
        except Exception:
            results[case.name] = {"__crash__": traceback.format_exc()}
    (root / f"check_{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
