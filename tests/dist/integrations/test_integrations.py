"""Trainer integrations with the real trainers on 4 gloo CPU ranks, and ReplicaWatch.

One spawn runs every scenario of tests/dist/integrations/integration_scenarios.py;
``test_scenario[<name>]`` checks one: no error on any rank, the ranks agree, its checks hold.
"""

from __future__ import annotations

from typing import Any

import pytest

import fsdpcheck
from tests.dist.integrations.integration_scenarios import REGISTRY
from tests.dist_harness import Checks, run_ranks, scenario_result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(
        4,
        "tests.dist.integrations.integration_scenarios:run_world",
        tmp_path_factory.mktemp("integrations"),
    )


CHECKS = checks = Checks(REGISTRY)


@pytest.mark.parametrize("name", list(REGISTRY.scenarios))
def test_scenario(name: str, ranks: list[dict]) -> None:
    CHECKS[name](scenario_result(ranks, name))


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


def keys_kinds(report: dict) -> list[tuple[str, str]]:
    return [(f[0], f[1]) for f in report["findings"]]


# --- ReplicaWatch ---------------------------------------------------------------------------
@checks("watch_hsdp_clean")
def watch_never_fires_on_a_clean_run(reports):
    assert [r is not None for r in reports] == [False, True] * 3  # every 2nd step
    for r in reports[1::2]:
        assert r["ok"], r["text"]


@checks("watch_hsdp_replica_perturbed")
def watch_names_the_perturbed_replica_and_its_ranks(reports):
    assert reports[1]["ok"], reports[1]["text"]  # step 2: before the fault
    for r in (reports[3], reports[5]):  # steps 4 and 6: caught, and still there
        assert keys_kinds(r) == [("blocks.0.w1.weight", "replica")], r["text"]
        assert r["findings"][0][2] == [1, 3]  # rank 1 and its replica (same shard) rank 3


@checks("watch_optimizer_step_differs")
def watch_names_a_rank_whose_optimizer_step_differs(reports):
    assert reports[1]["ok"], reports[1]["text"]
    r = reports[3]
    # The step itself, and the weight it then updated differently (Adam's bias correction)
    # from its replica on rank 0.
    assert keys_kinds(r) == [
        ("head.weight", "replica"),
        ("optim.state.head.weight.step", "replica"),
    ], r["text"]
    assert r["findings"][0][2] == [0, 2] and r["findings"][1][2] == [0, 1, 2, 3]
    assert "ranks [0, 1, 3] hold one value, ranks [2] another" in r["text"]


@checks("watch_ddp_perturbed")
def watch_catches_a_ddp_replica(reports):
    assert reports[1]["ok"], reports[1]["text"]
    r = reports[3]
    assert keys_kinds(r) == [("emb.weight", "replica")], r["text"]
    assert "ranks [0, 1, 2] hold one value, ranks [3] another" in r["text"]


# --- torchtitan -------------------------------------------------------------------------------
@checks("torchtitan_resume")
def torchtitan_resume_is_verified(r):
    assert "fsdpcheck_manifest.json" in r["files"]
    assert not r["fresh"]["ok"]  # different weights before the load: every key differs
    assert r["clean"]["ok"], r["clean"]["text"]
    assert any("manifest" in n for n in r["clean"]["notes"])
    assert keys_kinds(r["planted"]) == [("blocks.1.w1.weight", "value")], r["planted"]["text"]
    # Every tensor (model and optimizer state) checked against the files, and equal.
    assert not [
        f for f in r["no_manifest"]["findings"] if not f[0].startswith("optim.param_groups")
    ]
    assert any("no fsdpcheck manifest" in n for n in r["no_manifest"]["notes"])


def test_torchtitan_no_manifest_hyperparameters(ranks: list[dict]) -> None:
    r = scenario_result(ranks, "torchtitan_resume")["no_manifest"]
    assert r["ok"], r["text"]


@checks("torchtitan_no_checkpoint")
def torchtitan_fresh_start_has_nothing_to_verify(r):
    assert r["loaded"] is False
    assert r["report"]["ok"] and "fresh start" in r["report"]["notes"][0]


# --- Lightning ----------------------------------------------------------------------------------
@checks("lightning_trainer_resume")
def lightning_trainer_resume_is_verified(r):
    assert r["is_dir"]  # ModelParallelStrategy writes a DCP directory
    assert r["clean"]["ok"], r["clean"]["text"]
    assert r["watch"]["ok"], r["watch"]["text"]
    assert r["raised"] == "VerificationError"
    assert keys_kinds(r["planted"]) == [("net.head.weight", "value")], r["planted"]["text"]
    assert r["planted"]["findings"][0][4] == 1  # the rank holding the changed element


@checks("lightning_fabric_resume")
def lightning_fabric_load_is_verified(r):
    assert r["clean"]["ok"], r["clean"]["text"]
    assert keys_kinds(r["planted"]) == [("blocks.0.w2.weight", "value")], r["planted"]["text"]
    assert r["planted"]["findings"][0][4] == 2


# --- Hugging Face Trainer --------------------------------------------------------------------
@checks("transformers_resume")
def transformers_resume_is_verified(r):
    assert {"model.safetensors", "optimizer.pt", "fsdpcheck_manifest.json"} <= set(r["files"])
    assert r["clean"]["ok"], r["clean"]["text"]
    assert any("manifest" in n for n in r["clean"]["notes"])
    assert r["watch"]["ok"], r["watch"]["text"]
    assert r["raised"] == "VerificationError"
    assert keys_kinds(r["planted"]) == [("model.layers.0.mlp.up_proj.weight", "value")], r[
        "planted"
    ]["text"]


# --- Lightning without a strategy (one process, a .ckpt file) --------------------------------
def test_lightning_plain_ckpt_resume_is_verified(tmp_path) -> None:
    import lightning as L
    import torch

    from fsdpcheck.integrations.lightning import VerifyOnResume

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
            )

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class ChangeOneWeight(L.Callback):  # after the restore, before the resume check
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            with torch.no_grad():
                pl_module.net[2].weight[1, 3] += 1

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2)),
        batch_size=4,
    )
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                 enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer = L.Trainer(max_steps=3, **quiet)
    trainer.fit(Module(), data)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    assert fsdpcheck.describe_path(ckpt).layout == "lightning"

    clean = VerifyOnResume()
    L.Trainer(max_steps=4, callbacks=[clean], **quiet).fit(Module(), data, ckpt_path=ckpt)
    assert clean.report is not None and clean.report.ok, str(clean.report)
    assert clean.report.keys_checked == 4 + 4 * 3  # parameters, AdamW state by integer id

    changed = VerifyOnResume()
    with pytest.raises(fsdpcheck.VerificationError, match=r"net\.2\.weight"):
        L.Trainer(max_steps=4, callbacks=[ChangeOneWeight(), changed], **quiet).fit(
            Module(), data, ckpt_path=ckpt
        )
    (f,) = changed.report.findings
    assert (f.key, f.kind, f.max_abs_index) == ("net.2.weight", "value", (1, 3))


# --- the failure policy the trainer callbacks share -------------------------------------------
class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(("info", msg % args))

    def error(self, msg: str, *args: object) -> None:
        self.lines.append(("error", msg % args))


@pytest.mark.parametrize("leader", [True, False])
@pytest.mark.parametrize("policy", ["raise", "stop", "warn"])
def test_resume_policy_raise_stop_warn(policy: str, leader: bool) -> None:
    from fsdpcheck.integrations import lightning, transformers
    from fsdpcheck.integrations._resume import ON_FAILURE, ResumeCheck
    from fsdpcheck.report import Finding, Report

    assert lightning.ON_FAILURE is transformers.ON_FAILURE is ON_FAILURE == (
        "raise", "stop", "warn"
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"on_failure must be one of .*'halt'"):
        ResumeCheck(on_failure="halt", watch_every=None, verify_kwargs={})
    bad = Report(findings=[Finding("w", "value", "differs")])
    good = Report(keys_checked=1)
    check = ResumeCheck(on_failure=policy, watch_every=None, verify_kwargs={})
    log, stops = _Log(), []

    def handle(report: Report) -> None:
        check.handle(report, "resume", log=log, leader=leader, stop=lambda: stops.append(1))

    if policy == "raise":
        with pytest.raises(fsdpcheck.VerificationError, match="w"):
            handle(bad)
    else:
        handle(bad)
    assert stops == ([1] if policy == "stop" else [])
    failed = (
        [("error", f"fsdpcheck: resume failed:\n{bad}")] if leader and policy != "raise" else []
    )
    assert log.lines == failed
    handle(good)
    assert log.lines[len(failed) :] == (
        [("info", f"fsdpcheck: resume: {good.summary()}")] if leader else []
    )
    assert stops == ([1] if policy == "stop" else [])
    assert check.watch_step() is None  # no watch asked for
