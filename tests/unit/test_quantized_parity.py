"""FP8 and INT4 experts: engine output and every gradient vs the float64 reference run on the dequantized
weights, on each kernel set, and module behaviour that differs from BF16 (buffers, moves, no base grads)."""
import pytest
import torch

import kt_sft
from experts_case import Shape, inputs, make_module, run_engine, run_reference
from test_experts_parity import SHAPES as BF16_SHAPES
from test_experts_parity import RUNNABLE, TILE_KERNELS, check, kernels, tiles  # noqa: F401  (the kernel-set fixtures)
from tolerances import (BF16_DOT, BF16_DOT_DW, BF16_IO, FP32_IO, QUANTIZED_IO, for_kernels, for_quantized_kernels,
                        rel_l2)

# fp8_rows: FP8 with blocks one row high (checkpoints with a scale per output channel).
FORMATS = ["fp8", "fp8_rows", "int4"]

# Blocks of 128 and groups of 32 partial in both directions, and a decode shape across several blocks; the rest
# are the BF16 parity edges that quantized weights change nothing about but must still pass.
SHAPES = [
    Shape("partial_blocks", T=40, H=200, I=136, E=4, K=2),
    Shape("experts_without_tokens", T=3, H=160, I=64, E=16, K=2),
    Shape("all_tokens_on_one_expert", T=33, H=96, I=48, E=4, K=1, routing="one"),
    Shape("t1_decode", T=1, H=300, I=70, E=8, K=4),
    # one and two rows per expert over whole INT4 groups: the split decode on the avx2 and avx512 sets
    Shape("decode_whole_groups", T=1, H=96, I=64, E=4, K=2, routing="few"),
    Shape("two_rows_whole_groups", T=2, H=96, I=64, E=4, K=2, routing="few"),
    # the one-row dot forms' edges: passes of 4 weight rows ending short (gate/up's 70 rows, down's 102), and a
    # reduction of 17 whole 64-column steps and half of one (H = 1120)
    Shape("decode_row_edges", T=1, H=96, I=70, E=4, K=2, routing="few"),
    Shape("decode_down_row_edges", T=1, H=102, I=64, E=4, K=2, routing="few"),
    Shape("decode_long_reduction", T=1, H=1120, I=64, E=4, K=2, routing="few"),
] + [s for s in BF16_SHAPES if s.name in ("odd_h_and_i", "large_t", "rank_above_tile", "rank_256", "no_tokens",
                                           "chunked_long_reductions")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_quantized_parity_fp32(kernels, fmt, shape):
    m = make_module(shape, lora=True, expert_format=fmt)
    x, idx, w, g = inputs(shape)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), QUANTIZED_IO, shape)


# FP8 grids are told apart by their scale rows, which for gate/up read alike at I = 1 and for down at H = 1.
@pytest.mark.parametrize("H, I", [(200, 1), (1, 70)])
def test_fp8_row_blocks_where_one_projection_has_one_row(kernels, H, I):
    shape = Shape("one_row", T=6, H=H, I=I, E=4, K=2)
    m = make_module(shape, lora=True, expert_format="fp8_rows")
    assert m.gate_up_scale.shape[2] == I and m.down_scale.shape[1] == H
    x, idx, w, g = inputs(shape)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), QUANTIZED_IO, shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_without_lora_and_bf16_activations(kernels, fmt):
    shape = SHAPES[0]
    m = make_module(shape, lora=False, expert_format=fmt)
    x, idx, w, g = inputs(shape)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), QUANTIZED_IO, shape)
    check_bf16_activations(fmt, shape, kernels)


# One or two rows per expert (decode) with BF16 activations: the decode kernels of every set (on amx, rows not on
# tiles).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s.name in ("experts_without_tokens", "t1_decode")
                                    or s.name.startswith("decode_")], ids=lambda s: s.name)
def test_quantized_decode_with_bf16_activations(kernels, fmt, shape):
    check_bf16_activations(fmt, shape, kernels)


def check_bf16_activations(fmt, shape, kernels):
    m = make_module(shape, lora=True, expert_format=fmt)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    got = run_engine(m, x, idx, w, g)
    assert got["y"].dtype == torch.bfloat16
    check(got, run_reference(m, x, idx, w, g), for_quantized_kernels(kernels, BF16_IO, bf16_activations=True), shape)


# H = I = 2048: the backward's activation rows padded past 4 KB apart (kernels.h nn_ld) against decoded panels.
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES + [Shape("nn_rows_4k_apart", T=40, H=2048, I=2048, E=2, K=1, r=4)],
                         ids=lambda s: s.name)
def test_quantized_bf16_activations_on_tiles(tiles, fmt, shape):
    m = make_module(shape, lora=True, expert_format=fmt)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
          for_quantized_kernels(tiles, BF16_IO, bf16_activations=True), shape)


# FP8 and INT4 rows off the tiles with BF16 activations (quantized_bf16_dot.h on the sets with tiles; FP8 where the
# CPU has AVX-512 VBMI) take any number of rows per expert, one alone or two at a time and at most 64 per pass over
# the weights: odd counts, over 64 rows, a last step shorter than 64 columns (H = 96: 64 + 32; I = 160: 128 + 32;
# H = 32: that step alone; FP8 also I = 70: 64 + 6), and weight row blocks cut short (I = 70: gate's and up's last 6
# rows, past 4 with two rows at a time and 8 with one; INT4's down over 70 columns, not whole groups, takes the
# float32 kernel).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", TILE_KERNELS)
@pytest.mark.parametrize("shape", [Shape("rows_off_tiles", T=37, H=96, I=160, E=4, K=2),
                                   Shape("short_row_block", T=9, H=96, I=70, E=4, K=2),
                                   Shape("three_rows", T=3, H=64, I=96, E=2, K=2),
                                   Shape("rows_past_one_pass", T=150, H=96, I=160, E=2, K=1),
                                   Shape("one_row_one_step", T=1, H=32, I=70, E=2, K=1, routing="few"),
                                   Shape("one_row_down_short_step", T=1, H=40, I=96, E=2, K=1, routing="few")],
                         ids=lambda s: s.name)
def test_quantized_bf16_activations_off_tiles(fmt, name, shape):
    if name not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {name} kernels")
    kt_sft.configure(kernels=name, tile_min_rows=1 << 20)
    try:
        m = make_module(shape, lora=True, expert_format=fmt)
        x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
        check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
              for_quantized_kernels(name, BF16_IO, bf16_activations=True), shape)
    finally:
        kt_sft.configure(kernels="", tile_min_rows=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_weight_rounding_stays_within_the_tile_bounds(fmt):
    # The tile products round decoded FP8/INT4 weights to BF16: that rounding alone (the float64 reference rerun
    # on the rounded weights) must leave half of each bound the tile tests allow, or the bounds are too tight.
    for shape in SHAPES:
        m = make_module(shape, lora=True, expert_format=fmt)
        x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
        exact = run_reference(m, x, idx, w, g)
        gu, dn = m.base_weights()
        m.base_weights = lambda: (gu.bfloat16().double(), dn.bfloat16().double())
        rounded = run_reference(m, x, idx, w, g)
        for key, ref in exact.items():
            bound = BF16_DOT_DW if key == "dw" else BF16_DOT
            assert rel_l2(rounded[key], ref) <= bound / 2, f"{shape.name}: {key}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weights_stay_put_and_out_of_state_dict(fmt):
    shape = SHAPES[4]
    m = make_module(shape, lora=True, expert_format=fmt)
    before = {n: (b.data_ptr(), b.dtype) for n, b in m.named_buffers()}
    m.double()  # dtype moves skip the experts (as device moves do)
    assert {n: (b.data_ptr(), b.dtype) for n, b in m.named_buffers()} == before
    assert not [k for k in m.state_dict() if "proj" in k and "lora" not in k]
    assert all(not b.requires_grad for b in m.buffers())
    x, idx, w, g = inputs(shape)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), QUANTIZED_IO, shape)
    fmt = fmt.removesuffix("_rows")
    assert m.expert_format == fmt and f"format={fmt}" in repr(m)


def test_quantized_forward_matches_bf16_within_quantization_error():
    shape = SHAPES[0]
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        ref = make_module(shape, lora=False)(x, idx, w)
        for fmt, bound in (("fp8", 0.08), ("int4", 0.2)):  # e4m3 keeps 3 mantissa bits; int4 16 levels per group
            err = ((make_module(shape, lora=False, expert_format=fmt)(x, idx, w) - ref).norm() / ref.norm()).item()
            assert 0 < err < bound, (fmt, err)


# Decode on one thread: every routed expert's forward items widen to 512 columns (experts.cpp decode_width), the last
# of gate/up's (I = 700) and down's (H = 1100) short. BF16 weights too, with both activation dtypes.
WIDE_DECODE = Shape("decode_wide_items", T=1, H=1100, I=700, E=8, K=8, r=4)


@pytest.mark.parametrize("fmt", ["bf16"] + FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_act"])
def test_decode_in_wide_items_on_one_thread(kernels, fmt, dtype):
    m = make_module(WIDE_DECODE, lora=True, expert_format=fmt)
    x, idx, w, g = inputs(WIDE_DECODE, dtype=dtype)
    kt_sft.configure(threads=1)
    try:
        got = run_engine(m, x, idx, w, g)
    finally:
        kt_sft.configure(threads=0)
    if fmt == "bf16":  # BF16 weights: the BF16 experts' own bounds (test_experts_parity)
        tol = for_kernels(kernels, BF16_IO if dtype == torch.bfloat16 else FP32_IO, dtype == torch.bfloat16)
    else:
        tol = for_quantized_kernels(kernels, BF16_IO if dtype == torch.bfloat16 else QUANTIZED_IO,
                                    dtype == torch.bfloat16)
    check(got, run_reference(m, x, idx, w, g), tol, WIDE_DECODE)


# FP8 and INT4 experts beside zero-computation ones (LongCat-Flash's, quantized at load): pairs routed to no expert
# (id -1) and to the identity experts (ids E and E + 1), training and decode.
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s.name in ("partial_blocks", "t1_decode")],
                         ids=lambda s: s.name)
def test_quantized_experts_beside_identity_experts(kernels, fmt, shape):
    m = make_module(shape, lora=True, expert_format=fmt, identity_experts=2)
    x, idx, w, g = inputs(shape)
    idx = idx.clone()
    idx.view(-1)[::3] = -1
    idx.view(-1)[1::5] = shape.E + torch.arange(len(idx.view(-1)[1::5])) % 2
    got = run_engine(m, x, idx, w, g)
    assert (got["dw"][idx == -1] == 0).all()
    check(got, run_reference(m, x, idx, w, g), QUANTIZED_IO, shape)
