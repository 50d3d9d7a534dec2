"""Engine output and every gradient vs autograd through the float64 reference, on each kernel set."""
import pytest
import torch

import kt_sft
from experts_case import Shape, inputs, make_module, run_engine, run_reference
from tolerances import BF16_GRAD, BF16_IO, FP32_IO, for_kernels, rel_l2

ALL_KERNELS = ["reference", "avx2", "avx512", "avx512_bf16", "amx"]
RUNNABLE = kt_sft.capabilities()["runnable_kernels"]

SHAPES = [
    Shape("typical", T=40, H=64, I=48, E=8, K=2),
    Shape("experts_without_tokens", T=3, H=64, I=32, E=16, K=2),
    Shape("all_tokens_on_one_expert", T=33, H=32, I=48, E=4, K=1, routing="one"),
    # every token names expert 0 K times: an expert gets more rows than there are tokens
    Shape("repeated_expert_ids", T=5, H=40, I=24, E=4, K=3, routing="one"),
    Shape("k1", T=17, H=48, I=32, E=4, K=1),
    Shape("t1_decode", T=1, H=96, I=64, E=8, K=4),
    Shape("odd_h_and_i", T=19, H=37, I=29, E=5, K=3, r=3),
    # a decode-sized call on a narrow layer: the down phase in 16-column blocks (two per thread), the last partial
    Shape("decode_odd_h", T=6, H=45, I=29, E=6, K=2, r=3),
    Shape("single_expert", T=11, H=40, I=24, E=1, K=1),
    Shape("large_t", T=512, H=64, I=80, E=8, K=2, r=4),
    Shape("rank_1", T=9, H=32, I=16, E=3, K=2, r=1),
    Shape("rank_above_tile", T=21, H=48, I=40, E=4, K=2, r=37),
    # one row per expert against LoRA rows of up to 64 floats, partial vectors and exactly four
    Shape("decode_rank_37", T=2, H=45, I=29, E=8, K=3, r=37),
    Shape("decode_rank_64", T=2, H=80, I=48, E=8, K=3, r=64),
    # the largest rank, far above H and I: LoRA-B grad blocks outgrow the weight-grad tiles
    Shape("rank_256", T=12, H=64, I=32, E=3, K=2, r=256),
    Shape("no_tokens", T=0, H=32, I=16, E=4, K=2),
    # H above the kernels' K chunk (2048) and not a multiple of it; enough rows to widen weight tiles
    Shape("chunked_long_reductions", T=48, H=2100, I=40, E=2, K=1, r=4),
]


@pytest.fixture(params=ALL_KERNELS)
def kernels(request):
    name = request.param
    if name not in RUNNABLE:
        why = f"; tiles: {kt_sft.capabilities()['tiles']}" if name == "amx" else ""
        pytest.skip(f"this CPU cannot run the {name} kernels (it runs {RUNNABLE}{why})")
    kt_sft.set_kernels(name)
    yield name
    kt_sft.set_kernels(None)


def check(got, ref, tol, shape):
    for key, r in ref.items():
        g = got[key]
        assert g is not None, f"{key} missing"
        assert g.shape == r.shape, key
        assert torch.isfinite(g).all(), f"{key} not finite"
        if shape.T:
            assert g.abs().sum() > 0, f"{key} is all zeros"
        err, bound = rel_l2(g, r), tol.get(key, tol["*"]) if isinstance(tol, dict) else tol
        assert err <= bound, f"{shape.name}: {key} rel L2 {err:.2e} > {bound:.0e}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "no_lora"])
def test_lora_parity_fp32(kernels, shape, lora):
    m = make_module(shape, lora=lora)
    x, idx, w, g = inputs(shape)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), FP32_IO, shape)


def some_projections_case(case, dtype=torch.float32):
    """Engine and reference results with LoRA on up and down only, gate's A frozen, or down's B frozen."""
    shape = SHAPES[0]
    m = make_module(shape, lora=False)
    m.add_lora(shape.r, alpha=2.0 * shape.r, projections=("up", "down") if case == "up_and_down_only" else
               ("gate", "up", "down"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in m.lora_B["default"].values():
            p.normal_(0, 0.05, generator=gen)
    frozen = {"gate_A_frozen": ("lora_A", "gate", "dA_gate"), "down_B_frozen": ("lora_B", "down", "dB_down")}.get(case)
    if frozen:
        getattr(m, frozen[0])["default"][frozen[1]].requires_grad_(False)
    x, idx, w, g = inputs(shape, dtype=dtype)
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    if frozen:
        assert got.pop(frozen[2]) is None
        ref.pop(frozen[2])
    return got, ref, shape


@pytest.mark.parametrize("case", ["up_and_down_only", "gate_A_frozen", "down_B_frozen"])
def test_lora_grads_of_some_projections(kernels, case):
    # Gate's and up's A grads share a work item: each must come out right when the other has none.
    got, ref, shape = some_projections_case(case)
    check(got, ref, FP32_IO, shape)


@pytest.mark.parametrize("case", ["up_and_down_only", "gate_A_frozen", "down_B_frozen"])
def test_lora_grads_of_some_projections_on_tiles(tiles, case):
    got, ref, shape = some_projections_case(case, torch.bfloat16)
    check(got, ref, for_kernels(tiles, BF16_IO, bf16_activations=True), shape)


@pytest.mark.parametrize("shape", SHAPES[:6], ids=lambda s: s.name)
def test_full_mode_parity(kernels, shape):
    m = make_module(shape, lora=True, train_base=True)
    x, idx, w, g = inputs(shape)
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    # Base grads land in BF16 param.grad (the parameters' dtype): one rounding.
    for key in ("d_gate_up", "d_down"):
        err = rel_l2(got.pop(key), ref.pop(key))
        assert err <= BF16_GRAD, f"{key} rel L2 {err:.2e}"
    check(got, ref, FP32_IO, shape)


# Decode-sized shapes too: experts with one or two rows take short row blocks (on amx, rows not on tiles).
BF16_ACTIVATION_SHAPES = [s for s in SHAPES if s.name in ("typical", "experts_without_tokens", "t1_decode",
                                                          "decode_odd_h")]


@pytest.mark.parametrize("shape", BF16_ACTIVATION_SHAPES, ids=lambda s: s.name)
def test_bf16_activations(kernels, shape):
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    got = run_engine(m, x, idx, w, g)
    assert got["y"].dtype == torch.bfloat16 and got["dx"].dtype == torch.bfloat16
    check(got, run_reference(m, x, idx, w, g), for_kernels(kernels, BF16_IO, bf16_activations=True), shape)


TILE_KERNELS = ["amx", "avx512_bf16"]  # the tile unit, and its operations on vdpbf16ps


@pytest.fixture(params=[(k, rows) for k in TILE_KERNELS for rows in (1, 8)],
                ids=lambda p: f"{p[0]}-tile_min_rows_{p[1]}")
def tiles(request):
    """A kernel set with tile products and tile_min_rows = `rows` (1 or 8): forwards take the tiles from it on amx,
    from twice it on avx512_bf16 (INT4 weights four times), backwards from rows / 4 (at least 1), so that with 8
    experts of 2-7 rows (on avx512_bf16 2-15, INT4's 2-31) run their forward off the tiles and their backward on
    them; yields its name."""
    name, rows = request.param
    if name not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {name} kernels ({kt_sft.capabilities()['tiles']})")
    kt_sft.configure(kernels=name, tile_min_rows=rows)
    yield name
    kt_sft.configure(kernels="", tile_min_rows=0)


# BF16 activations through the tile products: every shape, odd sizes taking the decoded-panel path,
# multiples of 16/32 the in-place weight loads, and reductions long enough that the axpy form's panels outgrow
# kPanelBytes and are reduced in chunks: the backward's weight panels (dout·Wd over H, dx over 2I and LoRA's
# ranks), and the weight grads' activation panels of an expert with over 2048 rows (a reduction over its rows).
# Rows of the nn layout 4 KB apart get a padding block (kernels.h nn_ld): activation grads of H = I = 2048, and
# two experts of 2048 rows each, whose transposed rank-space blocks lie side by side.
@pytest.mark.parametrize("shape", SHAPES + [Shape("tile_multiples", T=96, H=128, I=64, E=4, K=2),
                                            Shape("chunked_panels", T=40, H=2100, I=2100, E=2, K=1, r=4),
                                            Shape("chunked_row_reduction", T=2100, H=256, I=256, E=2, K=1, r=4,
                                                  routing="one"),
                                            Shape("nn_rows_4k_apart", T=40, H=2048, I=2048, E=2, K=1, r=4),
                                            Shape("rank_rows_4k_apart", T=2048, H=64, I=64, E=3, K=2, r=4,
                                                  routing="few")],
                         ids=lambda s: s.name)
def test_bf16_activations_on_tiles(tiles, shape):
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
          for_kernels(tiles, BF16_IO, bf16_activations=True), shape)


# Every row count of one expert from a lone block column to two pairs: the emulated tiles take a last odd block
# column together with the pair before it, and a last one of at most 8 valid lanes (the forward's activation
# rows) on 256-bit registers, leave out row groups past the valid ones (the backward's), and run a last group of
# 1-4 valid rows in a pass of 1, 2 or 4. H = 40 and I = 44 give the backward's weight panels such a last block
# column too (8 and 12 of its 16 columns valid).
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 12, 17, 18, 19, 24, 32, 33, 40, 48, 56])
def test_partly_filled_tiles(tiles, rows):
    shape = Shape(f"rows_{rows}", T=rows, H=40, I=44, E=2, K=1, r=4, routing="one")
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
          for_kernels(tiles, BF16_IO, bf16_activations=True), shape)


@pytest.mark.parametrize("T", [1, 2])
def test_bf16_decode_on_tiles(tiles, T):
    # BF16 inference takes the tiles from the fixture's 1 row per expert on amx and 2 on avx512_bf16 (T = 2 has
    # such experts), from 8 and 16 not at all here; experts of at most two rows take gate's and up's LoRA inputs
    # in the float32 dot form.
    shape = Shape(f"decode_t{T}", T=T, H=96, I=64, E=8, K=4)
    m = make_module(shape, lora=True).eval()
    x, idx, w, _ = inputs(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        y = m(x, idx, w)
    ref = run_reference(m, x, idx, w, torch.zeros_like(x))["y"]
    assert rel_l2(y, ref) <= for_kernels(tiles, BF16_IO, bf16_activations=True)


def test_base_grads_accumulate_across_micro_batches(kernels):
    shape = SHAPES[0]
    m = make_module(shape, lora=False, train_base=True)
    m.gate_up_proj.grad = None
    x, idx, w, g = inputs(shape)
    for seed in (1, 2):
        x, idx, w, g = inputs(shape, seed=seed)
        m(x, idx, w).backward(g)
    ref_gu = 0
    for seed in (1, 2):
        x, idx, w, g = inputs(shape, seed=seed)
        ref_gu = ref_gu + run_reference(m, x, idx, w, g)["d_gate_up"]
    assert rel_l2(m.gate_up_proj.grad, ref_gu) <= BF16_GRAD


def test_lora_grads_across_steps_and_micro_batches(kernels):
    """LoRA grads land in param.grad straight from the engine when it is None (a reused buffer, while nothing else
    holds it), and the engine adds into that same grad when it is not: two micro-batches give the sum, a step
    after zero_grad starts afresh, and zero_grad(set_to_none=False) leaves zeros that the next micro-batch adds
    to."""
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    batches = [inputs(shape, seed=s) for s in (1, 2)]
    refs = [run_reference(m, *b) for b in batches]
    A, B = m.lora_A["default"], m.lora_B["default"]
    grads_after_first = None
    for x, idx, w, g in batches:
        m(x, idx, w).backward(g)
        grads_after_first = grads_after_first or [t.grad for t in (*A.values(), *B.values())]
    assert all(t.grad is first for t, first in zip((*A.values(), *B.values()), grads_after_first))
    for p in A:
        assert rel_l2(A[p].grad, refs[0][f"dA_{p}"] + refs[1][f"dA_{p}"]) <= FP32_IO
        assert rel_l2(B[p].grad, refs[0][f"dB_{p}"] + refs[1][f"dB_{p}"]) <= FP32_IO
    first = A["gate"].grad.data_ptr()
    grads_after_first = None  # held, they would take new buffers (test_engine_behaviour)
    m.zero_grad(set_to_none=True)
    x, idx, w, g = batches[1]
    m(x, idx, w).backward(g)
    assert A["gate"].grad.data_ptr() == first  # the buffer is reused, not reallocated
    for p in A:
        assert rel_l2(A[p].grad, refs[1][f"dA_{p}"]) <= FP32_IO
    m.zero_grad(set_to_none=False)
    x, idx, w, g = batches[0]
    m(x, idx, w).backward(g)
    assert A["gate"].grad.data_ptr() == first
    for p in A:
        assert rel_l2(A[p].grad, refs[0][f"dA_{p}"]) <= FP32_IO
        assert rel_l2(B[p].grad, refs[0][f"dB_{p}"]) <= FP32_IO


def test_lora_dominated_on_tiles(tiles):
    """LoRA B twenty times the usual draw, so the LoRA terms outweigh the base weights' in every output: a wrong
    scale or a lost segment of a fused tile product (dx sums Wg, Wu and s·Ag, s·Au in one panel) shows."""
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    with torch.no_grad():
        for p in m.lora_B["default"].values():
            p.mul_(20)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g),
          for_kernels(tiles, BF16_IO, bf16_activations=True), shape)


def test_lora_grads_accumulate_on_tiles(tiles):
    """On tiles, LoRA A grads are added by the tile products' stores and B grads through their transpose: two
    BF16 micro-batches give the sum of their grads."""
    shape = SHAPES[0]
    m = make_module(shape, lora=True)
    batches = [inputs(shape, seed=s, dtype=torch.bfloat16) for s in (1, 2)]
    refs = [run_reference(m, *b) for b in batches]
    for x, idx, w, g in batches:
        m(x, idx, w).backward(g)
    bound = for_kernels(tiles, BF16_IO, bf16_activations=True)
    for name, params in (("dA", m.lora_A["default"]), ("dB", m.lora_B["default"])):
        for p, t in params.items():
            assert rel_l2(t.grad, refs[0][f"{name}_{p}"] + refs[1][f"{name}_{p}"]) <= bound, f"{name}_{p}"


def test_inference_forward_saves_nothing_and_matches(kernels):
    shape = SHAPES[4]
    m = make_module(shape, lora=True)
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        y = m(x, idx, w)
    assert y.grad_fn is None
    ref = run_reference(m, x, idx, w, torch.zeros_like(x))["y"]
    assert rel_l2(y, ref) <= FP32_IO


# Pairs routed to no expert (id -1: LongCat-Flash's zero-computation experts, which KTExperts adds in PyTorch, so
# only experts that have such take it) add nothing and get a zero weight grad; a token of only such pairs gets a
# zero row. Decode sizes take the one-phase forward, the others the three phases.
@pytest.mark.parametrize("shape", [SHAPES[0], Shape("decode_t1", T=1, H=96, I=64, E=8, K=4),
                                   Shape("decode_t2", T=2, H=96, I=64, E=8, K=4)], ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_pairs_routed_to_no_expert(kernels, shape, mode):
    m = make_module(shape, lora=mode == "lora", train_base=mode == "full", identity_experts=1)
    x, idx, w, g = inputs(shape)
    idx = idx.clone()
    idx.view(-1)[::3] = -1
    if shape.T > 2:
        idx[0] = -1
    got, ref = run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g)
    assert (got["dw"][idx == -1] == 0).all()
    for key in ("d_gate_up", "d_down") if mode == "full" else ():  # BF16 param.grad, as test_full_mode_parity's
        err = rel_l2(got.pop(key), ref.pop(key))
        assert err <= BF16_GRAD, f"{key} rel L2 {err:.2e}"
    check(got, ref, FP32_IO, shape)
    if shape.T > 2:
        assert (got["y"][0] == 0).all()


# Zero-computation experts (ids E to E + Z - 1) return their token times its weight, beside the routed experts;
# ids past them are refused, naming them.
@pytest.mark.parametrize("T", [1, 40])
def test_identity_experts_return_their_tokens(kernels, T):
    shape = Shape("identity", T=T, H=64, I=48, E=6, K=3)
    m = make_module(shape, lora=True, identity_experts=3)
    x, _, w, g = inputs(shape)
    idx = torch.stack([torch.randperm(9, generator=torch.Generator().manual_seed(t))[:3] for t in range(T)])
    idx[0] = torch.tensor([6, 8, 1])  # the routed and the identity experts both
    check(run_engine(m, x, idx, w, g), run_reference(m, x, idx, w, g), FP32_IO, shape)
    with pytest.raises(ValueError, match=r"expert id 9 .* ids 6 to 8 are this layer's zero-computation experts"):
        m(x, torch.where(idx == idx[0, 0], 9, idx), w)


@pytest.mark.parametrize("T", [2, 40])
def test_pairs_routed_to_no_expert_on_tiles(tiles, T):
    shape = Shape("no_expert_tiles", T=T, H=64, I=48, E=4, K=3)
    m = make_module(shape, lora=True, identity_experts=1)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    idx = idx.clone()
    idx.view(-1)[1::3] = -1
    got = run_engine(m, x, idx, w, g)
    assert (got["dw"][idx == -1] == 0).all()
    check(got, run_reference(m, x, idx, w, g), for_kernels(tiles, BF16_IO, bf16_activations=True), shape)
