"""The backward copy (KT_SFT_BACKWARD_COPY=1): the backward's tile products read the weights packed ahead instead of
packing each item's panel, and must give bit-identical results (the same BF16 pairs summed in the same order),
also after the weights change in place."""
import contextlib

import pytest
import torch

from experts_case import Shape, inputs, make_module, run_engine
import kt_sft
from kt_sft._ext import view
from kt_sft.ops.reference import RELU2, SWIGLU
from test_experts_parity import RUNNABLE, SHAPES, tiles  # noqa: F401 (tiles: the tile kernel sets, a fixture)


def run(m, case, copy: bool, monkeypatch):
    monkeypatch.setenv("KT_SFT_BACKWARD_COPY", "1" if copy else "0")
    return run_engine(m, *case)


def assert_same(got, want):
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert (got[key] is None) == (v is None), key
        if v is not None:
            assert torch.equal(got[key], v), f"{key} differs with the backward copy"


# Edges of the copy's layout: odd H and I (a lone last block column, rows past the matrix), reductions longer than
# a panel chunk, experts with many rows; T = 1 and no tokens take no tiles and must not trip over the copy. Experts
# without a gate (relu²) have a copy of up's matrix alone and a dx of up's product alone.
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("unit", [SWIGLU, RELU2], ids=["swiglu", "relu2"])
def test_same_grads_with_copy(tiles, shape, unit, monkeypatch):
    m = make_module(shape, lora=True, unit=unit)
    case = inputs(shape, dtype=torch.bfloat16)
    assert_same(run(m, case, True, monkeypatch), run(m, case, False, monkeypatch))


def test_same_grads_with_dropout_and_some_projections(tiles, monkeypatch):
    # LoRA dropout splits dx into a product per projection; LoRA on up and down only leaves gate's segment alone.
    shape = SHAPES[0]
    m = make_module(shape, lora=False)
    m.add_lora(shape.r, 2.0 * shape.r, projections=("up", "down"), dropout=0.25)
    with torch.no_grad():
        for p in m.lora_B["default"].values():
            p.normal_(0, 0.05)
    case = inputs(shape, dtype=torch.bfloat16)
    torch.manual_seed(3)
    with_copy = run(m, case, True, monkeypatch)
    torch.manual_seed(3)
    assert_same(with_copy, run(m, case, False, monkeypatch))


def test_copy_follows_weight_changes(tiles, monkeypatch):
    shape = Shape("wide", T=64, H=96, I=64, E=4, K=2)
    m = make_module(shape, lora=True)
    case = inputs(shape, dtype=torch.bfloat16)
    run(m, case, True, monkeypatch)  # the copy is built here
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen).bfloat16() * 0.1)
    m.down_proj.data.mul_(-2)  # through .data too
    fresh = make_module(shape, lora=True)
    with torch.no_grad():
        fresh.gate_up_proj.copy_(m.gate_up_proj)
        fresh.down_proj.copy_(m.down_proj)
    assert_same(run(m, case, True, monkeypatch), run(fresh, case, False, monkeypatch))
    m.merge_lora("default")  # written into the weights in place, the adapter still applied on top
    merged = make_module(shape, lora=True)
    with torch.no_grad():
        merged.gate_up_proj.copy_(m.gate_up_proj)
        merged.down_proj.copy_(m.down_proj)
    assert_same(run(m, case, True, monkeypatch), run(merged, case, False, monkeypatch))


@pytest.mark.parametrize("master", [False, True], ids=["bf16_weights", "float32_master"])
def test_full_mode_repacks_after_each_step(tiles, master, monkeypatch):
    # Base weights trained with a fused optimizer (no version bump): the copy must follow every step, also where the
    # optimizer updates a float32 master that reaches the engine's BF16 weights at the next forward.
    shape = SHAPES[0]
    runs = []
    for copy in (True, False):
        m = make_module(shape, lora=False, train_base=True)
        if master:
            for p in (m.gate_up_proj, m.down_proj):
                p.data = p.data.float()
        opt = torch.optim.AdamW([m.gate_up_proj, m.down_proj], lr=1e-2, fused=True)
        case = inputs(shape, dtype=torch.bfloat16)
        grads = []
        for _ in range(3):
            with (pytest.warns(RuntimeWarning, match="packs the copy again after every optimizer step") if copy
                  else contextlib.nullcontext()):
                grads.append(run(m, case, copy, monkeypatch))
            opt.step()
        runs.append(grads)
    for got, want in zip(*runs):
        assert_same(got, want)


def test_copy_is_dropped_when_turned_off(tiles, monkeypatch):
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    case = inputs(shape, dtype=torch.bfloat16)
    run(m, case, True, monkeypatch)
    assert "_backward_copy" in m.__dict__
    run(m, case, False, monkeypatch)
    assert "_backward_copy" not in m.__dict__


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_experts_refuse_the_copy(fmt, monkeypatch):
    shape = SHAPES[0]
    m = make_module(shape, lora=True, expert_format=fmt)
    case = inputs(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KT_SFT_BACKWARD_COPY=1 keeps a BF16 copy of BF16 experts, but these are"):
        run(m, case, True, monkeypatch)


def test_engine_checks_the_copy_shape():
    m = make_module(SHAPES[0], lora=False)
    with pytest.raises(ValueError, match="backward copy of gate_up"):
        m.engine.pack_backward_copy((view(torch.empty(3, dtype=torch.bfloat16)),
                                     view(torch.empty(3, dtype=torch.bfloat16))))


def test_no_copy_without_room(tiles, monkeypatch):
    # Short of host RAM the module trains without its copy, with a warning, and the gradients are the same.
    from kt_sft.nn import experts
    monkeypatch.setattr(experts.host_memory, "host_headroom", lambda: (1 << 30, 1 << 34))
    monkeypatch.setattr(experts, "_short_of_copy_room", [])
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    case = inputs(shape, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="layers without one train without it"):
        got = run(m, case, True, monkeypatch)
    assert "_backward_copy" not in m.__dict__
    assert_same(got, run(m, case, False, monkeypatch))


@pytest.mark.parametrize("why", ["float32 activations", "kernel set without tiles"])
def test_no_copy_where_nothing_reads_it(why, monkeypatch):
    from kt_sft.nn import experts
    monkeypatch.setattr(experts, "_copy_unread", [])
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    case = inputs(shape, dtype=torch.float32 if why == "float32 activations" else torch.bfloat16)
    if why != "float32 activations":
        kt_sft.set_kernels("avx512" if "avx512" in RUNNABLE else "avx2")
    try:
        with pytest.warns(RuntimeWarning, match="KT_SFT_BACKWARD_COPY=1 has no effect here"):
            run(m, case, True, monkeypatch)
    finally:
        kt_sft.set_kernels(None)
    assert "_backward_copy" not in m.__dict__
