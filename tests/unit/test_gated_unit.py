"""The gated units other than SwiGLU on the engine, against the float64 reference, output and every gradient, on each
kernel set, in BF16, FP8 and INT4. GPT-OSS's experts: gate/up and down biases and the clamped unit
(h = g'·sigmoid(1.702·g')·(u' + 1), g' = min(g, 7), u' = u clamped to ±7; the biases' grads in full mode). GeGLU with
the tanh-approximated gelu (Gemma 4), which the engine computes as g·sigmoid(2·√(2/π)·(g + 0.044715·g³)) and the
reference as torch's gelu(g, approximate="tanh"): the same function, rounded otherwise.

The gate/up bias (σ 4) puts many g and u past the clamps, where the gradient is cut: the engine's float32 g lies
within ~1e-6 relative of the reference's, so an element would take the other side of a clamp only within that of
±7, which no element of these seeded cases does (tolerances.py's bounds then hold unchanged)."""
import pytest
import torch

import kt_sft
from experts_case import Shape, inputs, make_module, run_engine, run_reference
from test_experts_parity import check, kernels, tiles  # noqa: F401 (fixtures)
from kt_sft.ops.reference import GEGLU_TANH, RELU2
from tolerances import BF16_GRAD, BF16_IO, FP32_IO, for_kernels, for_quantized_kernels, rel_l2

SHAPES = [
    Shape("typical", T=40, H=64, I=48, E=8, K=2),
    Shape("experts_without_tokens", T=3, H=64, I=32, E=16, K=2),
    Shape("all_tokens_on_one_expert", T=33, H=32, I=48, E=4, K=1, routing="one"),
    Shape("t1_decode", T=1, H=96, I=64, E=8, K=4),
    Shape("odd_h_and_i", T=19, H=37, I=29, E=5, K=3, r=3),
    # I past the engine's 64-column blocks, odd: the bias is added block by block
    Shape("wide_odd_i", T=24, H=48, I=150, E=3, K=2, r=4),
    Shape("no_tokens", T=0, H=32, I=16, E=4, K=2),
]


def clamped_share(m, x, idx):
    """The share of (token, expert) gate and up values past the clamps, from the reference's own products."""
    gu, _ = m.base_weights()
    b = m.gate_up_proj_bias.detach().float()
    pre = torch.einsum("th,tkoh->tko", x.float(), gu.float()[idx]) + b[idx]
    I = m.intermediate_size
    return ((pre[..., :I] > 7).float().mean().item(), (pre[..., I:].abs() > 7).float().mean().item())


def full_mode_check(got, ref, shape, tol):
    # Base weights' and biases' grads (where the experts have biases) land in BF16 param.grad: one rounding.
    for key in [k for k in ("d_gate_up", "d_down", "d_gate_up_proj_bias", "d_down_proj_bias") if k in ref]:
        err = rel_l2(got.pop(key), ref.pop(key))
        assert err <= max(BF16_GRAD, tol), f"{shape.name}: {key} rel L2 {err:.2e}"
    check(got, ref, tol, shape)


# Each unit's make_module arguments: GPT-OSS's with its biases; relu² of up without a gate (Nemotron-H).
UNITS = {"gpt_oss": dict(gpt_oss=True), "geglu": dict(unit=GEGLU_TANH), "relu2": dict(unit=RELU2)}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["lora", "full", "frozen"])
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_experts_parity_fp32(kernels, shape, mode, unit):
    m = make_module(shape, lora=mode != "full", train_base=mode == "full", **UNITS[unit])
    x, idx, w, g = inputs(shape)
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    if mode == "full":
        full_mode_check(got, ref, shape, FP32_IO)
    else:
        check(got, ref, FP32_IO, shape)


def test_the_cases_cross_the_clamps():
    shape = SHAPES[0]
    m = make_module(shape, lora=False, gpt_oss=True)
    x, idx, _, _ = inputs(shape)
    gate, up = clamped_share(m, x, idx)
    assert 0.02 < gate < 0.5 and 0.02 < up < 0.5, (gate, up)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[5]], ids=lambda s: s.name)
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_experts_bf16_activations(kernels, shape, unit):
    m = make_module(shape, lora=True, **UNITS[unit])
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
          for_kernels(kernels, BF16_IO, bf16_activations=True), shape)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], Shape("tile_multiples", T=96, H=128, I=64, E=4, K=2)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_experts_on_tiles(tiles, shape, mode, unit):
    m = make_module(shape, lora=True, train_base=mode == "full", **UNITS[unit])
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    tol = for_kernels(tiles, BF16_IO, bf16_activations=True)
    if mode == "full":
        full_mode_check(got, ref, shape, tol)
    else:
        check(got, ref, tol, shape)


@pytest.mark.parametrize("expert_format", ["fp8", "int4"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4]], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_experts_quantized(kernels, expert_format, shape, dtype, unit):
    m = make_module(shape, lora=True, expert_format=expert_format, **UNITS[unit])
    x, idx, w, g = inputs(shape, dtype=dtype)
    tol = for_quantized_kernels(kernels, FP32_IO if dtype == torch.float32 else BF16_IO,
                                bf16_activations=dtype == torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), tol, shape)


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_decode_matches(kernels, unit):
    shape = SHAPES[3]
    m = make_module(shape, lora=True, **UNITS[unit]).eval()
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        y = m(x, idx, w)
    assert rel_l2(y, run_reference(m, x, idx, w, torch.zeros_like(x))["y"]) <= FP32_IO


def test_bias_shapes_and_unit_are_checked():
    shape = SHAPES[0]
    m = make_module(shape, lora=False, gpt_oss=True)
    gu, dn = m.base_weights()
    with pytest.raises(ValueError, match=r"gate_up_proj_bias has shape \(8, 48\); these experts take \[8, 96\]"):
        kt_sft.KTExperts(gu, dn, gate_up_proj_bias=torch.zeros(8, 48))
    with pytest.raises(ValueError, match=r"down_proj_bias has shape \(8, 63\); these experts take \[8, 64\]"):
        kt_sft.KTExperts(gu, dn, down_proj_bias=torch.zeros(8, 63))
    with pytest.raises(ValueError, match="alpha > 0, limit > 0"):
        kt_sft.KTExperts(gu, dn, unit=(1.0, -1.0, 0.0))


def test_bad_inputs_get_the_inputs_message_with_a_down_bias():
    m = make_module(SHAPES[0], lora=False, gpt_oss=True)
    x, idx, w, _ = inputs(SHAPES[0])
    with pytest.raises(ValueError, match="top_k_index is torch.float32; it must hold integer expert ids"):
        m(x, idx.float(), w)
    with pytest.raises(ValueError, match=r"must both be \[T=40, K\]"):
        m(x, idx[:, :1], w)


def test_the_clamps_pass_no_gradient_at_the_limit_itself(kernels):
    # As torch's clamp: g = 7 or u = ±7 exactly (tokens of zeros, so that g and u are the bias) get no gradient
    # through the clamped side, and the reference agrees element for element.
    shape = Shape("ties", T=6, H=32, I=16, E=2, K=1, routing="one")
    m = make_module(shape, lora=False, train_base=True, gpt_oss=True)
    with torch.no_grad():
        m.gate_up_proj_bias[0, :4] = 7.0
        m.gate_up_proj_bias[0, 16:18] = 7.0
        m.gate_up_proj_bias[0, 18:20] = -7.0
    x, idx, w, g = inputs(shape)
    x[:3] = 0
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    full_mode_check(got, ref, shape, FP32_IO)


def test_non_finite_biases_are_refused():
    m = make_module(SHAPES[0], lora=False, gpt_oss=True)
    gu, dn = m.base_weights()
    bias = torch.zeros(8, 96)
    bias[3, 5] = float("nan")
    with pytest.raises(ValueError, match="gate_up_proj_bias holds NaN or Inf"):
        kt_sft.KTExperts(gu, dn, gate_up_proj_bias=bias)


def test_a_trained_gate_up_bias_reaches_the_forward_unrounded():
    # A trainer's upcast of trainable parameters (p.data = p.data.float()) leaves the float32 bias the engine
    # reads in place, so an optimizer step far below BF16's resolution changes the next forward.
    shape = SHAPES[0]
    m = make_module(shape, lora=False, train_base=True, gpt_oss=True)
    for p in m.parameters():
        p.data = p.data.float()
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        before = m(x, idx, w)
        m.gate_up_proj_bias.add_(1e-4)
        after = m(x, idx, w)
    assert m.gate_up_proj_bias.dtype == torch.float32
    assert not torch.equal(before, after)
    assert rel_l2(after, run_reference(m, x, idx, w, torch.zeros_like(x))["y"]) <= FP32_IO


def test_moves_keep_the_order_of_parameters():
    # Optimizer states are matched to parameters by position: a device or dtype move must not reorder them.
    m = make_module(SHAPES[0], lora=True, train_base=True, gpt_oss=True)
    names = [n for n, _ in m.named_parameters()]
    m.to(torch.float64)
    assert [n for n, _ in m.named_parameters()] == names
    assert m.down_proj_bias.dtype == torch.float64 and m.gate_up_proj_bias.dtype == torch.float32


def test_the_geglu_unit_matches_torch_far_out_and_the_cubic_is_checked():
    # Inputs far past the curve's bend (|g| up to ~60: the sigmoid saturates, g³ is large) and the cubic's range.
    shape = Shape("wide", T=32, H=16, I=16, E=2, K=1)
    m = make_module(shape, lora=False, train_base=True, unit=GEGLU_TANH)
    x, idx, w, g = inputs(shape)
    x = x * 30
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    full_mode_check(got, ref, shape, FP32_IO)
    gu, dn = m.base_weights()
    with pytest.raises(ValueError, match="a finite cubic >= 0"):
        kt_sft.KTExperts(gu, dn, unit=GEGLU_TANH._replace(cubic=-1.0))


def test_geglu_at_extreme_values_matches_torch_element_for_element(kernels):
    # Identity experts, so g = u = the token's value: h = gelu(v)·v. Where g³ overflows float32 (|v| > ~1e13) or the
    # exact sigmoid is 0 but the kernels' exp saturates short of it (v ≪ 0), the cubic's g is bounded (kernel_body.h
    # cubic_arg): no NaN, and no gradient where torch gives none.
    n = 16
    gu = torch.cat([torch.eye(n), torch.eye(n)]).bfloat16()[None]
    m = kt_sft.KTExperts(gu, torch.eye(n).bfloat16()[None], unit=GEGLU_TANH)
    values = torch.tensor([2e13, 1e13, 1e9, 30.0, 15.5, 3.0, 0.5, -0.5, -3.0, -15.5, -30.0, -1e8, -1e10, -2e13])
    values = values.bfloat16().float()
    x = values[:, None].repeat(1, n).requires_grad_(True)
    y = m(x, torch.zeros(len(values), 1, dtype=torch.int64), torch.ones(len(values), 1))
    y.backward(torch.ones_like(y))
    v = values.double().requires_grad_(True)
    ref = torch.nn.functional.gelu(v, approximate="tanh") * v
    ref.backward(torch.ones_like(ref))
    for got, want in ((y[:, 0], ref), (x.grad[:, 0], v.grad)):
        assert torch.isfinite(got).all()
        assert ((got.double() - want).abs() <= 1e-5 * want.abs() + 1e-6).all(), (values, got, want)
