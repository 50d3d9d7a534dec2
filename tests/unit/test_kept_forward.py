"""A training-mode forward without grad (gradient checkpointing's first pass) keeps the engine's pass, and the
forward with grad that follows takes it only when nothing that shapes the result changed
(kt_sft/ops/kept_forward.py): same results and gradients as running the engine, bit for bit."""
import pytest
import torch
from experts_case import Shape, inputs, make_module, run_engine

import kt_sft.ops.experts_function as function_module
from kt_sft.ops.kept_forward import MISSES_BEFORE_OFF

SHAPE = Shape("typical", T=40, H=64, I=48, E=8, K=2)


def first_pass(m, x, idx, w):
    with torch.no_grad():
        return m(x, idx, w)


def fresh(shape=SHAPE, dropout=0.0):
    m = make_module(shape, lora=True)
    m.lora_dropout_p["default"] = dropout
    m.train()
    return m


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "lora_dropout"])
def test_recompute_takes_the_kept_pass(dropout, monkeypatch):
    x, idx, w, g = inputs(SHAPE)
    twin = fresh(dropout=dropout)
    torch.manual_seed(5)
    expected = run_engine(twin, x, idx, w, g)
    m = fresh(dropout=dropout)
    torch.manual_seed(5)
    y0 = first_pass(m, x, idx, w)
    assert m.__dict__["_kept"] is not None
    calls = []
    real = function_module.run_forward
    monkeypatch.setattr(function_module, "run_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(5)  # checkpointing restores the RNG before the recompute
    got = run_engine(m, x, idx, w, g)
    assert calls == [], "the recompute ran the engine although the kept pass matched"
    assert m.__dict__.get("_kept") is None
    assert torch.equal(y0, got["y"])
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k


def changed_input(m, x, idx, w):
    return x + 1, idx, w


def changed_routing(m, x, idx, w):
    return x, idx.roll(1, 0), w


def changed_weights(m, x, idx, w):
    with torch.no_grad():
        m.lora_B["default"]["up"].add_(0.01)  # an optimizer step between the passes
    return x, idx, w


def changed_seed(m, x, idx, w):
    m.lora_dropout_p["default"] = 0.3
    torch.manual_seed(11)
    return x, idx, w


@pytest.mark.parametrize("change", [changed_input, changed_routing, changed_weights, changed_seed])
def test_a_changed_forward_runs_the_engine(change):
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    torch.manual_seed(5)
    first_pass(m, x, idx, w)
    x2, idx2, w2 = change(m, x, idx, w)
    state = torch.get_rng_state()
    got = run_engine(m, x2, idx2, w2, g)
    twin = fresh()
    twin.load_state_dict(m.state_dict())
    twin.lora_dropout_p["default"] = m.lora_dropout_p["default"]
    torch.set_rng_state(state)
    expected = run_engine(twin, x2, idx2, w2, g)
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k


def test_nothing_is_kept_in_eval_mode_or_when_turned_off(monkeypatch):
    x, idx, w, _ = inputs(SHAPE)
    m = fresh()
    m.eval()
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None
    m.train()
    monkeypatch.setenv("KT_SFT_RECOMPUTE_EXPERTS", "1")
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None


def test_the_first_pass_result_is_not_the_kept_one():
    # On the CPU the caller's result would otherwise be the very tensor the recompute hands out again.
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    y0 = first_pass(m, x, idx, w)
    y0.zero_()
    got = run_engine(m, x, idx, w, g)
    assert got["y"].abs().sum() > 0


def test_a_module_whose_recomputes_keep_missing_stops_keeping():
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    for i in range(MISSES_BEFORE_OFF):
        first_pass(m, x, idx, w)
        if i == MISSES_BEFORE_OFF - 1:
            with pytest.warns(RuntimeWarning, match="no longer keep their first pass"):
                run_engine(m, x + 1, idx, w, g)
        else:
            run_engine(m, x + 1, idx, w, g)
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None
