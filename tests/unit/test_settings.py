"""Arguments checked once, in ``CheckSettings``, with one line naming the argument.

verify, compare_checkpoints, fingerprint_checkpoint and load share the checks: a string
``ignore`` is one pattern (never its characters), tolerances are real numbers, flags are
booleans, and a user ``key_map`` that raises (torchtune's name converter raises on names it does
not know) or returns something that is not a key names the key it was called with.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpcheck
from fsdpcheck.tolerances import CheckSettings, KeyMapError


def _settings(**over: Any) -> CheckSettings:
    args: dict[str, Any] = {
        "rtol": None,
        "atol": None,
        "equal_nan": True,
        "check_dtype": True,
        "key_map": None,
        "ignore": None,
        "budget": 1 << 20,
    }
    args.update(over)
    return CheckSettings(**args)


def _pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A model with one wrong element and optimizer state, and its reference."""
    ref = {"w": torch.arange(6.0).reshape(2, 3), "optim.state.w.exp_avg": torch.ones(2, 3)}
    bad = {k: v.clone() for k, v in ref.items()}
    bad["w"][1, 2] += 1
    return bad, ref


# ------------------------------------------------------------------------------ ignore
def test_string_ignore_is_one_pattern() -> None:
    assert _settings(ignore="optim.*").ignore == ("optim.*",)
    assert _settings(ignore=["a*", "b"]).ignore == ("a*", "b")
    assert _settings(ignore=("a*",)).ignore == ("a*",)
    bad, ref = _pair()
    # Before: "optim.*" read as the patterns "o", "p", "t", ... ("*" among them) left out every
    # key: "OK: 0 compared".
    r = fsdpcheck.compare_checkpoints(bad, ref, ignore="optim.*")
    assert not r.ok and [(f.key, f.kind) for f in r.findings] == [("w", "value")], str(r)
    assert r.keys_checked == 1
    r = fsdpcheck.verify({"w": bad["w"]}, {"w": ref["w"]}, ignore="optim.*")
    assert not r.ok and r.keys_checked == 1, str(r)


def test_fingerprint_checkpoint_string_ignore(tmp_path: Path) -> None:
    bad, _ = _pair()
    torch.save(bad, tmp_path / "sd.pt")
    fps = fsdpcheck.fingerprint_checkpoint(tmp_path / "sd.pt", ignore="optim.*")
    assert sorted(fps) == ["w"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (3, "ignore must be a pattern (str) or a list of patterns, not 3 (int)"),
        (b"optim.*", "ignore must be a pattern (str) or a list of patterns, not b'optim.*'"),
        ({"optim.*": 1}, "ignore must be a pattern (str) or a list of patterns"),
        (["optim.*", 5], "ignore must hold patterns (str), not 5 (int)"),
        ([Path("w")], "ignore must hold patterns (str), not PosixPath('w')"),
    ],
)
def test_ignore_refused(value: Any, said: str) -> None:
    with pytest.raises(TypeError, match="^" + _re(said)):
        _settings(ignore=value)
    bad, ref = _pair()
    with pytest.raises(TypeError, match="^" + _re(said)):
        fsdpcheck.compare_checkpoints(bad, ref, ignore=value)


# ------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("name", ["rtol", "atol"])
def test_tolerances_are_real_numbers(name: str) -> None:
    assert getattr(_settings(**{name: 1}), name) == 1.0
    assert isinstance(getattr(_settings(**{name: 1}), name), float)
    assert getattr(_settings(**{name: 0.5}), name) == 0.5
    with pytest.raises(
        TypeError, match=f"^{name} must be a real number \\(or None\\), not '1e-3' \\(str\\)$"
    ):
        _settings(**{name: "1e-3"})
    with pytest.raises(TypeError, match=f"^{name} must be a real number"):
        _settings(**{name: True})
    with pytest.raises(TypeError, match=f"^{name} must be a real number"):
        _settings(**{name: torch.tensor(1e-3)})
    for bad in (-1e-3, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number >= 0, got "):
            _settings(**{name: bad})


def test_numpy_tolerance_accepted() -> None:
    np = pytest.importorskip("numpy")
    assert _settings(rtol=np.float32(0.25)).rtol == 0.25


def test_verify_and_compare_refuse_string_tolerance() -> None:
    bad, ref = _pair()
    with pytest.raises(TypeError, match=r"^rtol must be a real number"):
        fsdpcheck.compare_checkpoints(bad, ref, rtol="1e-3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^atol must be a real number"):
        fsdpcheck.verify({"w": bad["w"]}, {"w": ref["w"]}, atol="0.1")  # type: ignore[arg-type]
    # A real tolerance still works, as a float.
    r = fsdpcheck.compare_checkpoints(bad, ref, atol=2)
    assert r.ok, str(r)


@pytest.mark.parametrize("name", ["equal_nan", "check_dtype"])
def test_flags_are_booleans(name: str) -> None:
    with pytest.raises(TypeError, match=f"^{name} must be True or False, not 'False' \\(str\\)$"):
        _settings(**{name: "False"})
    with pytest.raises(TypeError, match=f"^{name} must be True or False, not 1 \\(int\\)$"):
        _settings(**{name: 1})


@pytest.mark.parametrize(
    ("value", "kind"), [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_budget(value: Any, kind: type) -> None:
    with pytest.raises(kind, match=r"^memory_budget must be a positive int \(bytes\)"):
        _settings(budget=value)
    bad, ref = _pair()
    with pytest.raises(kind, match=r"^memory_budget must be a positive int"):
        fsdpcheck.compare_checkpoints(bad, ref, memory_budget=value)
    with pytest.raises(kind, match=r"^memory_budget must be a positive int"):
        fsdpcheck.verify(bad, ref, memory_budget=value)
    with pytest.raises(kind, match=r"^memory_budget must be a positive int"):
        fsdpcheck.fingerprint_checkpoint(ref, memory_budget=value)


# ------------------------------------------------------------------------------ key_map
KNOWN = {"w": "w"}


def converter(key: str) -> str:
    """A name converter in torchtune's style: it raises on a name it does not know."""
    if key not in KNOWN:
        raise AssertionError("")
    return KNOWN[key]


def mapper_with_message(key: str) -> str:
    try:
        return KNOWN[key]
    except KeyError as e:
        raise Exception(f'Error converting the state dict. Found unexpected key: "{key}"') from e


def test_raising_key_map_names_the_key() -> None:
    bad, ref = _pair()
    live = {"w": bad["w"], "rope.cache": torch.zeros(2)}
    r = fsdpcheck.verify(live, ref, key_map=converter)
    assert not r.ok
    [f] = r.findings
    assert f.kind == "error"
    # Before: "AssertionError: ''" and nothing else.
    assert "key_map('rope.cache') raised AssertionError: make it return" in f.message, f.message
    # Offline, the error is raised (one process): it names the key and what the function said.
    with pytest.raises(KeyMapError) as info:
        fsdpcheck.compare_checkpoints(live, ref, key_map=mapper_with_message)
    assert str(info.value).startswith(
        "key_map('rope.cache') raised Exception: Error converting the state dict. Found "
        'unexpected key: "rope.cache": make it return'
    ), str(info.value)


def test_key_map_returning_a_non_key() -> None:
    s = _settings(key_map=lambda k: 3)
    with pytest.raises(KeyMapError, match=r"^key_map\('w'\) returned 3 \(int\): return the "):
        s.key_map("w")  # type: ignore[operator,misc]
    assert _settings(key_map=lambda k: None).key_map("w") is None  # type: ignore[operator,misc]


def test_key_map_mapping_checked() -> None:
    with pytest.raises(TypeError, match=r"^key_map must map names \(str\) to checkpoint keys"):
        _settings(key_map={"w": 3})
    with pytest.raises(TypeError, match=r"^key_map must be a mapping or a callable, not 'w'"):
        _settings(key_map="w")
    rules = fsdpcheck.matching.prefix_rules(["model.="])
    assert _settings(key_map=rules).key_map is rules  # prefix rules kept as they are
    assert _settings(key_map={"w": None}).key_map == {"w": None}


def test_checked_key_map_pickles_when_the_function_does() -> None:
    s = _settings(key_map=converter)
    back = pickle.loads(pickle.dumps(s))
    assert back.key_map("w") == "w"  # type: ignore[operator,misc]


def test_load_key_map_names_the_key(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    with pytest.raises(Exception, match=r"key_map\('(weight|bias)'\) raised AssertionError"):
        r = fsdpcheck.load(model, tmp_path / "m.pt", key_map=converter)
        assert "key_map('" in str(r)
        raise AssertionError(str(r))


def _re(text: str) -> str:
    import re

    return re.escape(text)
