"""FP8 block-128 and INT4 group-32 codecs against independent oracles, and their error checks."""
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

import kt_sft
from kt_sft.formats import QuantizedExperts, fp8_block, int4_group
from tolerances import rel_l2


class _Quantizer:  # the attributes transformers' FP8 conversion ops read from their quantizer (5.6 to 5.17)
    class quantization_config:
        weight_block_size = (128, 128)
        scale_fmt = "float"  # float32 block scales, as the DeepSeek-V3 checkpoints store them


@pytest.mark.parametrize("cols", [8, 37, 64, 200])
def test_int4_packing_matches_compressed_tensors(cols):
    q = torch.randint(-8, 8, (3, 5, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(cols))
    packed = int4_group.pack(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(int4_group.unpack(packed, cols), q)
    assert torch.equal(unpack_from_int32(packed[0], 4, torch.Size([5, cols])), q[0])


def test_int4_extremes_and_zero_groups():
    w = torch.zeros(2, 70)
    w[0, :32] = torch.linspace(-1, 1, 32)
    w[1, 40] = 1e-30  # tiny but non-zero: scale stays finite and the value rounds to 0 or ±1 step
    packed, scale = int4_group.quantize(w)
    assert scale.dtype == torch.bfloat16 and torch.isfinite(scale.float()).all()
    back = int4_group.dequantize(packed, scale, 70)
    assert back[0, 32:].abs().max() == 0 and back[1, :32].abs().max() == 0  # zero groups decode to zeros
    assert (back[0, :32] - w[0, :32]).abs().max() <= scale[0, 0].float() / 2 + 1e-6  # half a step
    assert int4_group.unpack(int4_group.pack(torch.tensor([[-8, 7, 0]], dtype=torch.int8)), 3).tolist() == [[-8, 7, 0]]


def test_fp8_matches_transformers_block_quantization():
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(0))
    ours_q, ours_s = fp8_block.quantize(w)
    theirs = Fp8Quantize(_Quantizer()).convert({"x.weight": [w]})
    assert torch.equal(ours_q.view(torch.uint8), theirs["x.weight"].view(torch.uint8))
    assert torch.allclose(ours_s, theirs["x.weight_scale_inv"], rtol=1e-6, atol=0)
    deq = Fp8Dequantize(_Quantizer()).convert({"weight$": [ours_q], "weight_scale_inv": [ours_s]}, full_layer_name="w")
    assert torch.equal(fp8_block.dequantize(ours_q, ours_s), deq["w"])


def test_fp8_partial_edge_blocks_and_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every finite code, subnormals and ±448 included
    q = codes.repeat(300 * 200 // len(codes) + 1)[: 300 * 200].reshape(300, 200).view(torch.float8_e4m3fn)
    s = torch.tensor([[0.5, 2.0], [3.0, 0.0], [1e-3, 7.0]])  # 3x2 blocks, two of them partial; one zero scale
    got = fp8_block.dequantize(q, s)
    rows = torch.arange(300) // 128
    cols = torch.arange(200) // 128
    want = q.float() * s[rows][:, cols]
    assert torch.equal(got, want)
    assert got[128:256, 128:].abs().max() == 0


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_requantize_gives_a_block_all_zero_before_the_change_a_fresh_scale(fmt):
    # quantize() gives an all-zero block or group scale 1: kept, a merged update of ~1e-3 there rounded to zero
    # (INT4) or to a grid 12x coarser than its own (FP8).
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2, 200, 300, generator=g)
    block = (0, slice(0, 128), slice(0, 128)) if fmt == "fp8" else (0, 0, slice(0, 32))
    scale_of = (0, 0, 0)
    w[block] = 0
    codec = fp8_block if fmt == "fp8" else int4_group
    dequantize = fp8_block.dequantize if fmt == "fp8" else lambda q, s: int4_group.dequantize(q, s, 300)
    q, s = codec.quantize(w)
    assert s[scale_of] == 1
    base = dequantize(q, s)
    new = base.clone()
    new[block] += 1e-3 * torch.randn(new[block].shape, generator=g)
    new_q, new_s = codec.requantize(new, s, base=base)
    assert new_s[scale_of] == codec.quantize(new)[1][scale_of]
    kept = torch.ones_like(s, dtype=torch.bool)
    kept[scale_of] = False
    assert torch.equal(new_s[kept], s[kept])
    change = new[block] - base[block]
    assert rel_l2(dequantize(new_q, new_s)[block] - base[block], change) < 0.2


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_requantize_keeps_the_published_grid(fmt):
    """A merged weight requantized on its published scales: unchanged values get their codes back bit for bit, a
    change within the grid's range moves codes by its rounding only, and a block or group that would clip (or had
    a zero scale) takes the scale quantize() gives it."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 200, 300, generator=g)  # partial edge blocks and groups
    if fmt == "fp8":
        q, s = fp8_block.quantize(w)
        same_q, same_s = fp8_block.requantize(fp8_block.dequantize(q, s), s)
        assert torch.equal(same_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(same_s, s)
        base = fp8_block.dequantize(q, s)
        grown = base.clone()
        grown[0, 5, 7] = 4 * base[0, :128, :128].abs().max()  # block (0, 0, 0) overflows its scale
        s_zero = s.clone()
        s_zero[1, 1, 2] = 0
        new_q, new_s = fp8_block.requantize(grown, s_zero)
        fresh_q, fresh_s = fp8_block.quantize(grown)
        for i in ((0, 0, 0), (1, 1, 2)):
            assert new_s[i] == fresh_s[i]
        kept = torch.ones_like(s, dtype=torch.bool)
        kept[0, 0, 0] = kept[1, 1, 2] = False
        assert torch.equal(new_s[kept], s[kept])
        back = fp8_block.dequantize(new_q, new_s)
        assert torch.equal(fp8_block.requantize(back, new_s)[0].view(torch.uint8), new_q.view(torch.uint8))
        # Scales stored in BF16: kept in BF16, and the codes computed with them as stored (1.7·w overflows every
        # block, whose fresh scales then round to BF16 before the codes are taken).
        q16, s16 = fp8_block.requantize(1.7 * w, s.to(torch.bfloat16))
        assert s16.dtype == torch.bfloat16
        want = (1.7 * w / fp8_block.expand_scales(s16.float(), 200, 300)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q16.view(torch.uint8), want.view(torch.uint8))
        return
    packed, s = int4_group.quantize(w)
    base = int4_group.dequantize(packed, s, 300)
    same_p, same_s = int4_group.requantize(base, s)
    assert torch.equal(same_p, packed) and torch.equal(same_s, s)
    step = int4_group.expand_scales(s.float(), 300)
    nudged = base + 0.3 * step * torch.sign(torch.randn(base.shape, generator=g))  # within half a step
    codes = int4_group.unpack(packed, 300)
    nudged[codes == 7] = base[codes == 7]  # keep every value inside the grid's range
    nudged[codes == -8] = base[codes == -8]
    assert torch.equal(int4_group.requantize(nudged, s)[0], packed)
    grown = base.clone()
    grown[1, 3, 40] = 20 * s[1, 3, 1].float()  # group (1, 3, 1) would clip
    s_zero = s.clone()
    s_zero[0, 0, 9] = 0
    new_p, new_s = int4_group.requantize(grown, s_zero)
    fresh_s = int4_group.quantize(grown)[1]
    assert new_s[1, 3, 1] == fresh_s[1, 3, 1] and new_s[0, 0, 9] == fresh_s[0, 0, 9]
    kept = torch.ones_like(s, dtype=torch.bool)
    kept[1, 3, 1] = kept[0, 0, 9] = False
    assert torch.equal(new_s[kept], s[kept])
    assert torch.equal(int4_group.unpack(new_p, 300)[kept.repeat_interleave(32, -1)[..., :300]],
                       codes[kept.repeat_interleave(32, -1)[..., :300]])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("projection", ["gate_up", "down"])
def test_bf16_expert_weights_that_are_not_finite_are_refused(value, projection):
    # Accepted, they turned every output and gradient of a token routed to that expert into NaN.
    gate_up, down = torch.randn(3, 8, 16).bfloat16(), torch.randn(3, 16, 4).bfloat16()
    (gate_up if projection == "gate_up" else down)[2, 1, 3] = value
    name = "gate/up" if projection == "gate_up" else "down"
    with pytest.raises(ValueError, match=f"expert 2's {name} weights hold NaN or Inf; the checkpoint is corrupt"):
        kt_sft.KTExperts(gate_up, down)


def test_bad_scales_and_codes_are_refused():
    q = QuantizedExperts.quantize("fp8", torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8_block.check(q.down, torch.full_like(q.down_scale, float("inf")))
    q.down_scale[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="expert 1's down scales hold NaN"):
        kt_sft.KTExperts(q)
    q.down_scale[1, 0, 0] = 1.0
    q.gate_up.view(torch.uint8)[0, 3, 5] = 0x7F
    with pytest.raises(ValueError, match="expert 0's FP8 weights hold NaN codes"):
        kt_sft.KTExperts(q)
    q4 = QuantizedExperts.quantize("int4", torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    q4.gate_up_scale[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="expert 0's gate/up scales hold NaN"):
        kt_sft.KTExperts(q4)
    with pytest.raises(ValueError, match="NaN or Inf group scales"):
        int4_group.dequantize(q4.gate_up, q4.gate_up_scale, 16)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantizing_nan_or_inf_is_refused(fmt, bad):
    # A NaN had come out as a whole group of zeros (INT4's scale 1, its codes 0) without a word.
    down = torch.randn(2, 16, 4)
    down[1, 3, 2] = bad
    with pytest.raises(ValueError, match="expert 1's down weight holds NaN or Inf values"):
        QuantizedExperts.quantize(fmt, torch.randn(2, 8, 16), down)


def test_fp8_nan_codes_are_refused_wherever_they_are_decoded():
    # The engine refused them in FP8 experts; decoded elsewhere (other weights, experts converted to BF16 or INT4
    # at load) they had become NaN logits or zeros.
    q, s = fp8_block.quantize(torch.randn(130, 20))
    q.view(torch.uint8)[129, 3] = 0xFF
    with pytest.raises(ValueError, match="o_proj.weight holds NaN codes"):
        fp8_block.dequantize(q, s, "o_proj.weight")


def test_shape_and_dtype_mismatches_are_refused():
    q = QuantizedExperts.quantize("int4", torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    with pytest.raises(ValueError, match="down scale .* has shape"):
        kt_sft.KTExperts(QuantizedExperts("int4", q.gate_up, q.down, q.gate_up_scale, q.down_scale[:, :8].contiguous()))
    with pytest.raises(ValueError, match="must be bfloat16"):
        kt_sft.KTExperts(QuantizedExperts("int4", q.gate_up, q.down, q.gate_up_scale, q.down_scale.float()))
    with pytest.raises(ValueError, match="int8 values in"):
        int4_group.pack(torch.tensor([[9]], dtype=torch.int8))
    with pytest.raises(ValueError, match="unknown expert format"):
        QuantizedExperts.empty("nf4", 1, 8, 8)
    with pytest.raises(ValueError, match="format 'nf4': the engine takes 'fp8' and 'int4'"):
        kt_sft.KTExperts(QuantizedExperts("nf4", q.gate_up, q.down, q.gate_up_scale, q.down_scale))
    with pytest.raises(ValueError, match="says 'fp8' but holds tensors of the int4_group32 layout"):
        kt_sft.KTExperts(QuantizedExperts("fp8", q.gate_up, q.down, q.gate_up_scale, q.down_scale))
    with pytest.raises(ValueError, match="pass no down_proj with it"):
        kt_sft.KTExperts(q, torch.randn(2, 16, 4))


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantizing_weights_of_other_shapes_is_refused(fmt):
    # INT4 had taken a down of I - 1 columns, its last column decoded from padding as -8 × the group's scale.
    gate_up, down = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    for bad_gate_up, bad_down in ((gate_up, down[..., :3]), (gate_up[:, :7], down), (gate_up, down[:1]),
                                  (gate_up[0], down)):
        with pytest.raises(ValueError, match="do not describe the same experts"):
            QuantizedExperts.quantize(fmt, bad_gate_up, bad_down)
    q = QuantizedExperts.empty(fmt, 2, 16, 4)
    with pytest.raises(ValueError, match="expert 1's gate, up and down weights have shapes"):
        q.set_expert(1, gate_up[1, :4], gate_up[1, 4:], down[1, :, :3])


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantizing_parameters_that_require_grad_keeps_no_autograd_graph(fmt):
    # A loaded model's experts are parameters: their codes and scales had carried a graph (~20x their bytes held)
    # and made the LoRA backward refuse as full-parameter training.
    gate_up, down = (torch.nn.Parameter(torch.randn(s)) for s in ((2, 8, 16), (2, 16, 4)))
    q = QuantizedExperts.quantize(fmt, gate_up, down)
    assert not any(t.requires_grad for t in (q.gate_up, q.down, q.gate_up_scale, q.down_scale))
    experts = kt_sft.KTExperts(q)
    experts.add_lora(2, 4.0)
    experts(torch.randn(3, 16), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)).sum().backward()
    assert experts.lora_A["default"]["gate"].grad is not None


def test_full_parameter_training_of_quantized_experts_is_refused():
    q = QuantizedExperts.quantize("fp8", torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    with pytest.raises(ValueError, match="full-parameter training of FP8 expert weights is not supported"):
        kt_sft.KTExperts(q, train_base=True)
