"""A converted compare against the plain compare of the same bytes and the script users write.

Builds a Llama-shaped model (bf16, about ``--size`` bytes) in torchtitan's layout (``wq``,
``wk``, ``wv``, ``feed_forward.w1/w2/w3``, ...) as one safetensors file, a byte-identical copy
of it, and its Hugging Face export made by torchtitan's own ``Llama3StateDictAdapter.to_hf``
(renames, q/k rows permuted within each head; with ``--spec``, or without torchtitan, the
same conversion stated as a spec). Then times, each in a fresh process, each the median of
``--reps`` rounds:

  * plain: ``compare_checkpoints(titan, titan_copy)``: the same bytes, no conversion;
  * converted: ``compare_checkpoints(titan, hf, convert=adapter.to_hf)``: every HF tensor
    compared piece by piece with the torchtitan tensors it is made of, never converting data;
  * gather-and-allclose: what a user writes today: ``load_file`` both, ``to_hf`` on the
    torchtitan tensors, ``torch.equal`` per key.

Reported: the time of the work alone (inside the process, after imports), its ratio to the
plain compare, and the peak growth of the process's own (anonymous) memory during the work,
against fsdpcheck's ``memory_budget``; and of its RSS, which also counts the pages of files
it maps (page cache).

Examples:
    python bench/bench_convert.py                    # ~1 GB per file
    python bench/bench_convert.py --size 200M --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DIM, HEADS, KV_HEADS, FFN, VOCAB = 2048, 32, 8, 5632, 32000
BUDGET = 256 << 20


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def _layers(size: int) -> int:
    hd = DIM // HEADS
    per_layer = (DIM * DIM * 2 + 2 * KV_HEADS * hd * DIM + 3 * FFN * DIM + 2 * DIM) * 2
    embed = 2 * VOCAB * DIM * 2 + DIM * 2
    return max(1, (size - embed) // per_layer)


def titan_config(layers: int) -> Any:
    """torchtitan's Llama3 config of this shape (for its adapter; no model is built)."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    return l3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=l3._build_llama3_layers(
            fuse_qkv=False, n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=FFN, rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=128,
                                                    theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )  # fmt: skip


def spec(layers: int) -> dict[str, Any]:
    """The same conversion as torchtitan's adapter, stated as a spec."""
    renames = {
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    rules: list[dict[str, Any]] = [
        {"from": "tok_embeddings.weight", "to": "model.embed_tokens.weight"},
        {"from": "norm.weight", "to": "model.norm.weight"},
        {"from": "lm_head.weight", "to": "lm_head.weight"},
        {"from": "layers.{i}.attention.qkv_linear.wq.weight",
         "to": "model.layers.{i}.self_attn.q_proj.weight",
         "ops": [{"op": "permute_heads", "heads": HEADS}]},
        {"from": "layers.{i}.attention.qkv_linear.wk.weight",
         "to": "model.layers.{i}.self_attn.k_proj.weight",
         "ops": [{"op": "permute_heads", "heads": KV_HEADS}]},
    ]  # fmt: skip
    for a, b in renames.items():
        a = a.replace("attention.wv", "attention.qkv_linear.wv")
        rules.append({"from": f"layers.{{i}}.{a}", "to": f"model.layers.{{i}}.{b}"})
    del layers
    return {"description": "torchtitan -> HF (spec)", "rules": rules, "others": "drop"}


def converter(layers: int, use_spec: bool) -> tuple[Any, str]:
    """torchtitan's own to_hf when it is installed (and not --spec), else the spec."""
    if not use_spec:
        try:
            from torchtitan.models.llama3 import Llama3StateDictAdapter

            return Llama3StateDictAdapter(titan_config(layers), None).to_hf, "torchtitan to_hf"
        except ImportError:
            pass
    return spec(layers), "spec"


def build(root: Path, size: int, use_spec: bool) -> tuple[int, str]:
    import torch
    from safetensors.torch import save_file

    layers = _layers(size)
    hd = DIM // HEADS
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"tok_embeddings.weight": r(VOCAB, DIM), "norm.weight": r(DIM),
          "lm_head.weight": r(VOCAB, DIM)}  # fmt: skip
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attention.qkv_linear.wq.weight"] = r(HEADS * hd, DIM)
        sd[p + "attention.qkv_linear.wk.weight"] = r(KV_HEADS * hd, DIM)
        sd[p + "attention.qkv_linear.wv.weight"] = r(KV_HEADS * hd, DIM)
        sd[p + "attention.wo.weight"] = r(DIM, HEADS * hd)
        sd[p + "feed_forward.w1.weight"] = r(FFN, DIM)
        sd[p + "feed_forward.w3.weight"] = r(FFN, DIM)
        sd[p + "feed_forward.w2.weight"] = r(DIM, FFN)
        sd[p + "attention_norm.weight"] = r(DIM)
        sd[p + "ffn_norm.weight"] = r(DIM)
    save_file(sd, str(root / "titan.safetensors"))
    shutil.copyfile(root / "titan.safetensors", root / "titan_copy.safetensors")
    fn, how = converter(layers, use_spec)
    if isinstance(fn, dict):
        from fsdpcheck.convert.spec import spec_function

        fn = spec_function(fn)[0]
    hf = {k: v.contiguous() for k, v in fn(dict(sd)).items()}
    save_file(hf, str(root / "hf.safetensors"))
    return layers, how


# -------------------------------------------------------------------------------------------
def child(kind: str, root: str, layers: int, use_spec: bool) -> None:
    """One measurement in this (fresh) process; prints JSON."""
    import torch

    import fsdpcheck
    import fsdpcheck.comparison
    import fsdpcheck.convert  # imported here: imports are not part of the work

    base = Path(root)
    fn, _ = converter(layers, use_spec)  # torchtitan's import alone takes seconds
    peak = _Peak()
    t0 = time.perf_counter()
    if kind == "plain":
        r = fsdpcheck.compare_checkpoints(
            base / "titan.safetensors", base / "titan_copy.safetensors", memory_budget=BUDGET
        )
        ok = r.ok
    elif kind == "converted":
        r = fsdpcheck.compare_checkpoints(
            base / "titan.safetensors", base / "hf.safetensors", convert=fn, memory_budget=BUDGET
        )
        ok = r.ok
    else:  # what users write: everything in memory, the conversion run on the data
        from safetensors.torch import load_file

        if isinstance(fn, dict):
            from fsdpcheck.convert.spec import spec_function

            fn = spec_function(fn)[0]
        a = fn(load_file(str(base / "titan.safetensors")))
        b = load_file(str(base / "hf.safetensors"))
        ok = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    work = time.perf_counter() - t0
    anon, total = peak.stop()
    print(json.dumps({"work": work, "anon": anon, "rss": total, "ok": ok}))


def _status() -> tuple[int, int]:
    """(RssAnon, VmRSS) of this process in bytes."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmRSS"):
            got[name] = int(value.split()[0]) * 1024
    return got["RssAnon"], got["VmRSS"]


class _Peak:
    """Peak growth of anonymous memory (what a process allocates: not the mapped files' pages,
    which the page cache holds anyway) and of the whole RSS, sampled every millisecond."""

    def __init__(self) -> None:
        import threading

        self.start = _status()
        self.high = self.start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            a, r = _status()
            self.high = (max(self.high[0], a), max(self.high[1], r))

    def stop(self) -> tuple[int, int]:
        self.done.set()
        self.thread.join()
        a, r = _status()
        high = (max(self.high[0], a), max(self.high[1], r))
        return high[0] - self.start[0], high[1] - self.start[1]


def _run(kind: str, root: Path, layers: int, use_spec: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", kind, str(root), str(layers)]
    if use_spec:
        argv.append("--spec")
    out = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="1G", help="bytes per file (default 1G)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spec", action="store_true", help="state the conversion as a spec")
    ap.add_argument("--keep", type=Path, help="build the data here and keep it")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, root, layers = args.child
        child(kind, root, int(layers), args.spec)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        layers, how = build(root, _size(args.size), args.spec)
        nbytes = (root / "titan.safetensors").stat().st_size
        for f in root.iterdir():  # warm the page cache: every row reads warm files
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        kinds = ("plain", "converted", "gather-and-allclose")
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for _ in range(args.reps):
            for k in kinds:
                got[k].append(_run(k, root, layers, args.spec))
        plain = statistics.median(x["work"] for x in got["plain"])
        print(f"# {_cpu()}, {os.cpu_count()} CPUs; torch {_torch_version()}")
        print(f"# {layers} layers, {nbytes / 1e9:.2f} GB per file (bf16); conversion: {how}; "
              f"memory_budget {BUDGET >> 20} MiB; median of {args.reps}")  # fmt: skip
        print(f"{'':22s} {'work s':>8s} {'x plain':>8s} {'GB/s':>7s} {'+anon MiB':>10s} "
              f"{'+RSS MiB':>9s} ok")  # fmt: skip
        for k in kinds:
            work = statistics.median(x["work"] for x in got[k])
            anon = max(x["anon"] for x in got[k]) / 2**20
            rss = max(x["rss"] for x in got[k]) / 2**20
            print(f"{k:22s} {work:8.2f} {work / plain:8.2f} {2 * nbytes / work / 1e9:7.2f} "
                  f"{anon:10.0f} {rss:9.0f} {all(x['ok'] for x in got[k])}")  # fmt: skip
        print(
            "# +anon: peak growth of the process's own memory during the work; +RSS: with "
            "the pages of the mapped files it touched (page cache)"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
