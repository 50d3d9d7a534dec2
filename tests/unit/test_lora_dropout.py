"""LoRA dropout on the routed experts: engine output and every gradient vs the float64 reference drawing the
same masks (kt_sft.ops.reference.lora_dropout_keep), on each kernel set; off in eval mode."""
import pytest
import torch

from experts_case import Shape, inputs, lora_of, make_module, run_engine
from kt_sft.ops.reference import RELU2, SWIGLU, LoraWeights, lora_dropout_keep, moe_experts_reference
from test_experts_parity import check, kernels, tiles  # noqa: F401  (the kernel-set and tile fixtures)
from tolerances import BF16_IO, FP32_IO, for_kernels, rel_l2

SHAPES = [
    Shape("typical", T=40, H=64, I=48, E=8, K=2),
    Shape("experts_without_tokens", T=3, H=64, I=32, E=16, K=2),
    Shape("odd_h_and_i", T=19, H=37, I=29, E=5, K=3, r=3),
    Shape("t1_decode", T=1, H=96, I=64, E=8, K=4),
    # more rows per expert than one chunk of the dropout buffers holds (64 · max(H, I) floats / row length)
    Shape("rows_beyond_a_chunk", T=300, H=16, I=8, E=2, K=1, r=4),
]


def reference_with_dropout(m, x, idx, w, gout, p, seed):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    gu, dn = (t.detach().double() for t in m.base_weights())
    A0, B0 = lora_of(m)
    A = {k: t.detach().double().requires_grad_() for k, t in A0.items()}
    B = {k: t.detach().double().requires_grad_() for k, t in B0.items()}
    y = moe_experts_reference(xd, idx, wd, gu, dn, LoraWeights(A, B, m.scaling["default"], p, seed), unit=m.unit)
    y.backward(gout.double())
    out = {"y": y.detach(), "dx": xd.grad, "dw": wd.grad}
    for k in A:
        out[f"dA_{k}"] = A[k].grad if A[k].grad is not None else torch.zeros_like(A[k])
        out[f"dB_{k}"] = B[k].grad if B[k].grad is not None else torch.zeros_like(B[k])
    return out


def seeded_run(m, x, idx, w, g, seed_state=7):
    torch.manual_seed(seed_state)  # the module draws its dropout seed from torch's RNG
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed_state)
    return run_engine(m, x, idx, w, g), seed


UNITS = pytest.mark.parametrize("unit", [SWIGLU, RELU2], ids=["swiglu", "relu2"])  # with a gate and without


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@UNITS
def test_dropout_parity(kernels, shape, fmt, unit):
    m = make_module(shape, lora=True, expert_format=fmt, unit=unit)
    m.lora_dropout["default"].p = 0.25
    m.train()
    x, idx, w, g = inputs(shape)
    got, seed = seeded_run(m, x, idx, w, g)
    check(got, reference_with_dropout(m, x, idx, w, g, 0.25, seed), FP32_IO, shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@UNITS
def test_dropout_parity_on_tiles(tiles, shape, unit):
    """BF16 activations on the tile unit: the masked LoRA operands are built in float32, then rounded for the
    tile products (in chunks of rows beyond the dropout buffers' size)."""
    m = make_module(shape, lora=True, unit=unit)
    m.lora_dropout["default"].p = 0.25
    m.train()
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    got, seed = seeded_run(m, x, idx, w, g)
    check(got, reference_with_dropout(m, x, idx, w, g, 0.25, seed), for_kernels(tiles, BF16_IO, True), shape)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4]], ids=lambda s: s.name)
def test_dropout_lora_grads_add_up_over_micro_batches(kernels, shape):
    """The engine adds the second micro-batch's LoRA grads into param.grad: with LoRA dropout (its chunked
    path) and with experts that get no token (nothing added for them)."""
    m = make_module(shape, lora=True)
    m.lora_dropout["default"].p = 0.25
    m.train()
    x, idx, w, g = inputs(shape)
    refs = []
    for seed_state in (7, 8):
        torch.manual_seed(seed_state)
        seed = int(torch.randint(0, 2**31, ()).item())
        torch.manual_seed(seed_state)
        m(x, idx, w).backward(g)
        refs.append(reference_with_dropout(m, x, idx, w, g, 0.25, seed))
    A, B = lora_of(m)
    for k in A:
        assert rel_l2(A[k].grad, refs[0][f"dA_{k}"] + refs[1][f"dA_{k}"]) <= FP32_IO
        assert rel_l2(B[k].grad, refs[0][f"dB_{k}"] + refs[1][f"dB_{k}"]) <= FP32_IO


def test_masks_drop_about_p_and_scale_the_rest():
    keep = lora_dropout_keep(3, 0, torch.arange(200), 500, 0.1)
    assert abs((keep == 0).double().mean().item() - 0.1) < 0.01
    assert torch.allclose(keep[keep > 0], torch.tensor(1 / 0.9, dtype=torch.float64))
    assert not torch.equal(keep, lora_dropout_keep(3, 1, torch.arange(200), 500, 0.1))  # per projection
    assert not torch.equal(keep, lora_dropout_keep(4, 0, torch.arange(200), 500, 0.1))  # per seed


def test_dropout_only_in_training_mode():
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        m.eval()
        base = m(x, idx, w)
        m.lora_dropout["default"].p = 0.5
        assert torch.equal(m(x, idx, w), base)
        m.train()
        assert not torch.equal(m(x, idx, w), base)


def test_bad_dropout_is_refused():
    m = make_module(SHAPES[0], lora=False)
    with pytest.raises(ValueError, match=r"LoRA dropout must be in \[0, 1\)"):
        m.add_lora(4, 8, dropout=1.0)
