"""fsdpcheck.testing on one process: faults change what they say and restore every bit on exit;
``unchanged`` catches changes, torch's lazy optimizer-state initialisation included."""

from __future__ import annotations

import pytest
import torch

from fsdpcheck import testing as T


def _model():
    return T.small_model(seed=3)


def _changed(model, opt, fault) -> list[str]:
    """Entries the fault changed while active; asserts the state is bit-identical after it."""
    before = T.snapshot(model, opt)
    with fault:
        inside = T.changes(before, T.snapshot(model, opt))
    assert T.changes(before, T.snapshot(model, opt)) == [], "not restored"
    return inside


def test_plant_changes_one_element_and_restores():
    m, opt = _model()
    w = m.get_parameter("0.weight")
    ref = w.detach().clone()
    with T.plant(w, (2, 3), delta=0.5):
        diff = (w != ref).nonzero().tolist()
        assert diff == [[2, 3]]
        assert w[2, 3] == ref[2, 3] + 0.5
    assert torch.equal(w, ref)
    with T.plant(w, 7, value=9.0):  # flat index 7 of a (7, 5) weight is (1, 2)
        assert w[1, 2] == 9.0 and (w != ref).sum() == 1
    assert _changed(m, opt, T.plant(w, 0)) == ["[0]param 0.weight"]


def test_plant_on_another_rank_does_nothing():
    m, opt = _model()
    assert _changed(m, opt, T.plant(m.get_parameter("0.weight"), (0, 0), on_rank=1)) == []


def test_flip_bit_flips_exactly_one_bit_and_restores():
    m, _ = _model()
    b = m.get_parameter("2.bias")
    ref = b.detach().clone()
    with T.flip_bit(b, 1, bit=31):  # the sign bit of a float32
        assert b[1] == -ref[1] and b[0] == ref[0] and b[2] == ref[2]
    assert torch.equal(b.view(torch.int32), ref.view(torch.int32))
    x = torch.tensor([1.0], dtype=torch.float64)
    with T.flip_bit(x, 0, bit=63):
        assert x.item() == -1.0
    assert x.item() == 1.0


def test_shift_shard_rolls_rows_and_restores():
    m, _ = _model()
    w = m.get_parameter("0.weight")
    ref = w.detach().clone()
    with T.shift_shard(w, 1):
        assert torch.equal(w[1:], ref[:-1]) and torch.equal(w[0], ref[-1])
    assert torch.equal(w, ref)


def test_zero_moment_and_drop_state():
    m, opt = _model()
    p = m.get_parameter("2.weight")
    assert _changed(m, opt, T.zero_moment(opt, p, "exp_avg")) == ["[1]optim.state.2.weight.exp_avg"]
    with T.zero_moment(opt, p):
        assert not opt.state[p]["exp_avg_sq"].any()
    order = list(opt.state[p])
    assert _changed(m, opt, T.drop_step(opt, p)) == [
        "[1]optim.state.2.weight keys",
        "[1]optim.state.2.weight.step",
    ]
    assert list(opt.state[p]) == order  # back in its place
    with pytest.raises(KeyError, match="nothing"), T.drop_state(opt, p, "nothing"):
        pass


def test_file_faults_restore_the_file(tmp_path):
    f = tmp_path / "blob.bin"
    data = bytes(range(40))
    f.write_bytes(data)
    with T.flip_byte(f, 5, 0x10):
        got = f.read_bytes()
        assert got[5] == 5 ^ 0x10 and got[:5] + got[6:] == data[:5] + data[6:]
    assert f.read_bytes() == data
    with T.truncate(f, 10):
        assert f.read_bytes() == data[:10]
    with T.truncate(f, -1):
        assert f.read_bytes() == data[:-1]
    assert f.read_bytes() == data
    t = torch.tensor([12, 13, 14], dtype=torch.uint8)
    assert T.find_bytes(f, t) == 12
    with pytest.raises(ValueError, match="not in"):
        T.find_bytes(f, torch.tensor([200], dtype=torch.uint8))


def test_unchanged_passes_when_nothing_changes_and_names_what_did():
    m, opt = _model()
    with T.unchanged(m, opt):
        m(torch.randn(3, 5))  # a forward pass changes no state
    with (
        pytest.raises(AssertionError, match=r"rank 0.*\[0\]param 2\.bias"),
        T.unchanged(m, opt),
        torch.no_grad(),
    ):
        m.get_parameter("2.bias")[0] += 1
    with pytest.raises(AssertionError, match=r"grad 0\.weight"), T.unchanged(m, opt):
        m(torch.randn(3, 5)).sum().backward()
    sd = {"a": torch.zeros(3)}
    with pytest.raises(AssertionError, match=r"\[0\]a"), T.unchanged(sd):
        sd["a"][1] = -0.0  # bit-exact: -0.0 is not 0.0
    with pytest.raises(AssertionError, match=r"\[0\]keys"), T.unchanged(sd):
        sd["b"] = torch.ones(1)


def test_unchanged_catches_torch_initialising_empty_optimizer_state():
    # get_optimizer_state_dict initialises an optimizer without state by taking a step (with
    # zero gradients, so AdamW's weight decay moves the weights): the change a checker must
    # never make.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with pytest.raises(AssertionError, match=r"optim\.state\.weight keys"), T.unchanged(m, opt):
        get_optimizer_state_dict(m, opt)


def test_models_and_local_of():
    m, _ = _model()
    assert T.local_of(m, "0.weight") is m.get_parameter("0.weight")
    with pytest.raises(KeyError, match="no parameter or buffer"):
        T.local_of(m, "nope")
    assert T.mesh_2d(4) == (2, 2) and T.mesh_2d(2) == (2, 1) and T.mesh_2d(3) == (3, 1)
    net = T.TinyTransformer(vocab=7, dim=6, hidden=10, out=3)
    assert len(list(net.parameters())) == 13
    with pytest.raises(ValueError, match="unknown layout"):
        T.build("zero3", 1)
