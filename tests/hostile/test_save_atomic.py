"""fsdpcheck.save against a kill at any instant, a symlinked target and a full disk.

Every test kills a real process: a forked child runs the save and is SIGKILLed either at a named
step (``saved._STEP_HOOK``) or at a random moment of a save loop. Afterwards the target must hold
one whole checkpoint, old or new (its data agree with its manifest, and equal one of the two
saved states), what is left beside it must be hidden scratch names, and the next save removes
them.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fsdpcheck
from fsdpcheck import saved, saving
from fsdpcheck.testing import small_model

# The steps of a save that replaces a checkpoint, in order, and which checkpoint the target
# holds after a kill right after each one.
STEPS = {
    "scratch made": "old",
    "state written": "old",
    "manifest written": "old",
    "published": "new",
    "old removed": "new",
}
FALLBACK_STEPS = {**STEPS, "old moved aside": None}  # None: briefly absent (documented)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m, opt = small_model(seed=seed)
    return m, opt


def _expected(seed: int) -> dict[str, int]:
    m, opt = _model(seed)
    return fsdpcheck.fingerprint(m, optimizer=opt)


def _in_child(fn: Callable[[], None]) -> int | None:
    """Runs `fn` in a forked child; its exit code (-9 when it was SIGKILLed)."""
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_quietly, args=(fn,))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
    return p.exitcode


def _quietly(fn: Callable[[], None]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    fn()


def _kill_at(step: str) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def whole_checkpoint(target: Path, candidates: dict[str, dict[str, int]]) -> str:
    """Which candidate the checkpoint at `target` is, after checking it is whole."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fsdpcheck.audit(target, deep=True).ok, str(fsdpcheck.audit(target, deep=True))
        data = fsdpcheck.fingerprint_checkpoint(target)
    manifest = fsdpcheck.read_manifest(target)
    assert manifest is not None and manifest.fingerprints() == data
    which = [name for name, fps in candidates.items() if fps == data]
    assert which, "the target holds neither the old nor the new checkpoint"
    return which[0]


def leftovers(parent: Path, name: str = "ck") -> list[str]:
    """Everything beside the target, after checking they are scratch names no reader takes."""
    rest = sorted(p.name for p in parent.iterdir() if p.name != name)
    for r in rest:
        assert r.startswith((f".{name}.fsdpcheck-tmp-", f".{name}.fsdpcheck-old-")), rest
    return rest


@pytest.fixture(scope="module")
def states() -> dict[str, dict[str, int]]:
    return {"old": _expected(0), "new": _expected(1)}


# ---------------------------------------------------------------------------------------------
KILLS = [(s, True) for s in STEPS] + [(s, False) for s in FALLBACK_STEPS]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("step", "exchange"), KILLS, ids=[f"{s}-{'exchange' if x else 'two-renames'}" for s, x in KILLS]
)
def test_a_kill_after_each_step_leaves_one_whole_checkpoint(tmp_path, states, step, exchange):
    target = tmp_path / "ck"
    m0, o0 = _model(0)
    fsdpcheck.save(m0, target, optimizer=o0)

    def child() -> None:
        saved._STEP_HOOK = _kill_at(step)
        if not exchange:
            saving._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
        m1, o1 = _model(1)
        fsdpcheck.save(m1, target, optimizer=o1, overwrite=True)
        os._exit(0)

    assert _in_child(child) == -signal.SIGKILL
    expected = FALLBACK_STEPS[step] if not exchange else STEPS[step]
    left = leftovers(tmp_path)
    if expected is None:  # between the two renames: both whole, under their hidden names
        assert not target.exists() and [n.split("-")[1] for n in left] == ["old", "tmp"]
        assert whole_checkpoint(tmp_path / left[0], states) == "old"
        assert whole_checkpoint(tmp_path / left[1], states) == "new"
    else:
        assert whole_checkpoint(target, states) == expected
        # A reader of the folder sees the checkpoint, not the scratch beside it.
        assert fsdpcheck.describe_path(target).layout == "fsdpcheck"
        if step != "old removed":
            assert left, "a kill before the cleanup leaves the scratch directory"
    # The next save removes every leftover.
    m2, o2 = _model(2)
    fsdpcheck.save(m2, target, optimizer=o2, overwrite=True)
    assert leftovers(tmp_path) == []
    assert whole_checkpoint(target, {"next": _expected(2)}) == "next"


@pytest.mark.slow
def test_a_sigkill_at_random_moments_of_a_save_loop(tmp_path, states):
    """A real SIGKILL at random instants (seeded) of back-to-back overwriting saves."""
    target = tmp_path / "ck"
    m0, o0 = _model(0)
    fsdpcheck.save(m0, target, optimizer=o0)
    t0 = time.perf_counter()
    m1, o1 = _model(1)
    fsdpcheck.save(m1, target, optimizer=o1, overwrite=True)
    one_save = time.perf_counter() - t0
    rng = random.Random(19)
    seen = set()
    interrupted = 0
    for i in range(8):

        def loop(start: int = i) -> None:
            models = [_model(0), _model(1)]
            k = start
            while True:
                m, o = models[k % 2]
                fsdpcheck.save(m, target, optimizer=o, overwrite=True)
                k += 1

        ctx = multiprocessing.get_context("fork")
        p = ctx.Process(target=_quietly, args=(loop,))
        p.start()
        time.sleep(rng.uniform(0.2, 0.2 + 3 * one_save))
        p.kill()
        p.join()
        seen.add(whole_checkpoint(target, states))
        interrupted += bool(leftovers(tmp_path))
    assert seen <= {"old", "new"}
    assert interrupted, "no kill landed inside a save"
    fsdpcheck.save(m0, target, optimizer=o0, overwrite=True)
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
def test_a_symlinked_target_is_written_through(tmp_path, states):
    """The link stays a link; the directory it leads to is replaced (before: the link was
    replaced by a real directory, then rmtree refused the link)."""
    real = tmp_path / "store" / "v1"
    real.parent.mkdir()
    m0, o0 = _model(0)
    fsdpcheck.save(m0, real, optimizer=o0)
    link = tmp_path / "ck"
    link.symlink_to(real)
    m1, o1 = _model(1)
    fsdpcheck.save(m1, link, optimizer=o1, overwrite=True)
    assert link.is_symlink() and link.resolve() == real
    assert whole_checkpoint(link, states) == "new"
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]
    # A link to nothing yet: the checkpoint is made where it points.
    dangling = tmp_path / "later"
    dangling.symlink_to(tmp_path / "store" / "v2")
    fsdpcheck.save(m0, dangling, optimizer=o0)
    assert dangling.is_symlink() and whole_checkpoint(tmp_path / "store" / "v2", states) == "old"
    # Without overwrite, a link to a checkpoint is refused before anything moves.
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        fsdpcheck.save(m0, link, optimizer=o0)
    assert whole_checkpoint(link, states) == "new"


def test_a_kill_inside_the_manifest_write_leaves_the_old_manifest(tmp_path, monkeypatch):
    """The manifest writers (save, trainer integrations) replace it in one rename; a link
    left where the manifest is gets replaced, not written through."""
    from fsdpcheck.manifest import MANIFEST_NAME, write_manifest

    m, o = _model(0)
    manifest = fsdpcheck.save(m, tmp_path / "ck", optimizer=o)
    folder = tmp_path / "ck"
    before = (folder / MANIFEST_NAME).read_bytes()

    def child() -> None:
        def killed(*_: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        os.fsync = killed  # dies with the new JSON written, before its rename
        write_manifest(folder, manifest)

    assert _in_child(child) == -signal.SIGKILL
    assert (folder / MANIFEST_NAME).read_bytes() == before
    left = [p.name for p in folder.iterdir() if p.name.startswith(f".{MANIFEST_NAME}.tmp-")]
    assert len(left) == 1
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (folder / MANIFEST_NAME).unlink()
    (folder / MANIFEST_NAME).symlink_to(outside)
    write_manifest(folder, manifest)
    assert outside.read_text() == "keep" and not (folder / MANIFEST_NAME).is_symlink()
    assert fsdpcheck.read_manifest(folder) == manifest
    assert not [p for p in folder.iterdir() if p.name.startswith(f".{MANIFEST_NAME}.tmp-")]


# ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only); skipped where mounting is refused."""
    d = tmp_path / "disk"
    d.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()[:100]}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_is_one_line_naming_the_cause_and_the_path(small_disk, states):
    target = small_disk / "ck"
    m0, o0 = _model(0)
    fsdpcheck.save(m0, target, optimizer=o0)
    big = torch.nn.Linear(1024, 1024)  # 4 MB of weights: more than the disk holds
    with pytest.raises(OSError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdpcheck.save(big, target, overwrite=True)
    text = str(e.value)
    assert "\n" not in text and "CheckpointException" not in text and "Traceback" not in text
    assert "No space left on device" in text and str(target) in text, text
    assert e.value.errno == 28 and text.startswith(f"fsdpcheck.save to {target} failed: ")
    assert whole_checkpoint(target, states) == "old"
    assert leftovers(small_disk) == []  # the scratch directory went with the failure


def test_a_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, states, monkeypatch):
    target = tmp_path / "ck"
    m0, o0 = _model(0)
    fsdpcheck.save(m0, target, optimizer=o0)
    monkeypatch.setattr(saving, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def fails_into_place(src, dst):
        if Path(dst) == target and ".fsdpcheck-tmp-" in str(src):
            raise OSError(5, "Input/output error", str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", fails_into_place)
    m1, o1 = _model(1)
    moving = re.escape(f"moving the checkpoint into {target} failed")
    with pytest.raises(RuntimeError, match=moving):
        fsdpcheck.save(m1, target, optimizer=o1, overwrite=True)
    assert whole_checkpoint(target, states) == "old" and leftovers(tmp_path) == []
