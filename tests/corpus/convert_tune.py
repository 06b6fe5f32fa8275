"""torchtune's conversions, checked in a process of their own (tests/corpus/test_convert_libs.py).

torchtune 0.6.1 needs torchao <= 0.14.1 (it imports ``int4_weight_only``), and peft 0.21 refuses
to run at all once a torchao older than 0.16 is importable: scripts/setup.sh installs torchao
0.11.0 into its own folder (``<venv>/torchao-for-torchtune``), which only this process puts on
its path. Run as ``python -m tests.corpus.convert_tune OUT_DIR TORCHAO_DIR``: it builds the
torchtune cases of tests/corpus/convert_libs.py, runs their checks and writes them to
``OUT_DIR/results.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any


def main(out: Path, torchao_dir: str) -> None:
    sys.path.append(torchao_dir)
    import torch

    import fsdpcheck
    from fsdpcheck.cli import main as cli_main
    from tests.corpus import convert_libs as cl

    results: dict[str, Any] = {}
    hf = cl.torchtune_hf(out)
    meta = cl.torchtune_meta(out, copy.deepcopy(hf.live))
    results["torchtune-hf"] = cl.checks(hf)
    results["torchtune-meta"] = cl.checks(meta)
    from torchtune.models import convert_weights

    extra: dict[str, Any] = {}
    # torchtune's HF files loaded into a fresh torchtune model through tune_to_hf.
    other = copy.deepcopy(hf.live)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    extra["load"] = cl.report_of(fsdpcheck.load(other, hf.clean, convert=hf.convert,
                                                verify="full"))  # fmt: skip
    extra["load_equal"] = fsdpcheck.fingerprint(other) == fsdpcheck.fingerprint(hf.live)

    def meta_to_hf(sd: dict) -> dict:  # torchtune's own two functions, one after the other
        return hf.convert(convert_weights.meta_to_tune(sd))

    assert meta.original is not None
    extra["meta_vs_hf"] = cl.report_of(
        fsdpcheck.compare_checkpoints(meta.clean, hf.clean, convert=meta_to_hf)
    )
    extra["meta_original_vs_hf"] = cl.report_of(
        fsdpcheck.compare_checkpoints(meta.original, hf.clean, convert=meta_to_hf)
    )
    extra["weight_left_out"] = cl.report_of(fsdpcheck.compare_checkpoints(
        meta.original, hf.clean,
        convert=lambda sd: meta_to_hf({k: v for k, v in sd.items() if k != "output.weight"}),
    ))  # fmt: skip
    extra["meta_vs_hf_no_hint"] = cl.report_of(
        fsdpcheck.compare_checkpoints(meta.original, hf.clean)
    )
    extra["meta_entries"] = len(fsdpcheck.fingerprint_checkpoint(meta.original))
    # The command line, naming torchtune's own function as module:attr.
    fp = out / "cli_fingerprint.json"
    how = "torchtune.models.convert_weights:meta_to_tune"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        extra["cli_rc"] = cli_main(["fingerprint", str(meta.original), "--convert", how, "--json"])
    fp.write_text(buf.getvalue())
    want = fsdpcheck.fingerprint_checkpoint(meta.original, convert=convert_weights.meta_to_tune)
    extra["cli_equal"] = json.loads(buf.getvalue()) == {k: f"0x{v:016x}" for k, v in want.items()}
    extra["cli_is_live"] = want == fsdpcheck.fingerprint(meta.live)
    results["extra"] = extra
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
