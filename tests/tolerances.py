"""The one tolerance table (STYLE.md 9): relative L2 error bounds against the float64 reference.

rel_l2(a, ref) = ||a - ref|| / ||ref||. The reference runs in float64 on exactly the engine's BF16 weight
values, so weight storage adds no error; what remains is the engine's own arithmetic.
"""

# float32 activations in and out. The engine accumulates in float32 (unit roundoff u = 6e-8); a
# reduction of length n has error growing like sqrt(n)·u for random signs, and the longest chain here
# (backward dW over tokens, forward over H) is a few thousand terms: ~3e-6. silu's exp is a degree-6
# polynomial (≤ 2 ulp). 2e-5 leaves a ~5x margin for the products of several such steps.
FP32_IO = 2e-5

# FP8 / INT4 experts with float32 activations: the reference runs on the dequantized weights, and the kernels
# decode exactly those values (FP8: code x scale rounded once to float32, as torch's dequantization does;
# INT4: a 4-bit integer times a BF16 scale, exact), so quantization adds no error against it and the
# float32 arithmetic bound applies unchanged. (Quantization error against the BF16 original is a property of
# the format, not of the kernels; test_quantized_parity bounds it separately.) One chain differs: AVX2's INT4
# decode (one or two rows per expert) sums code·x per group and takes 8·scale·Σx off once per row, a
# cancellation worth up to ~10x the plain chain's rounding; measured 1e-6 at H = 7168, inside the bound.
QUANTIZED_IO = FP32_IO

# bfloat16 activations in and out: every output element is rounded once to 8 mantissa bits
# (relative error ≤ 2^-9 = 2e-3, RMS ~1.1e-3 for uniform rounding); inputs are exact bf16 values.
# dx and outputs carry that one rounding; 4e-3 is twice the worst single rounding.
BF16_IO = 4e-3

# Base-weight grads accumulated into BF16 param.grad: one rounding per accumulation, as above.
BF16_GRAD = 4e-3

# With BF16 activations, the avx512_bf16 and amx kernels round the activations entering each projection to
# BF16 (x and dout, exact already; h = silu(g)·u in the forward, dg and du before dx on amx) and multiply
# BF16 pairs (vdpbf16ps, or the tile unit). One rounding has RMS relative error 2^-9/sqrt(3) = 1.1e-3 and a
# dot product of such terms keeps about that relative error. Outputs see two roundings in sequence (x, then
# h): ~1.6e-3; gradients reuse the saved g, u and add their own products, and silu' can amplify an input
# error up to ~1.1x. On the tile products (amx, avx512_bf16), FP8/INT4 weights are also rounded to BF16 once
# decoded (weight × scale to the nearest BF16: one more rounding of the same size per product), and the LoRA
# products of experts on tiles take BF16 operands (A, B, and the rank-space rows z = x·Aᵀ, wz = dy·B rounded once
# each, as stock PEFT's products under bf16 autocast; gate's and up's z of experts of at most two rows stay
# float32): one or two more roundings of that size in the LoRA terms and grads. 1e-2 leaves a 3-5x margin.
BF16_DOT = 1e-2


def for_kernels(kernels: str, bound: float, bf16_activations: bool) -> float:
    """The bound for a kernel set: BF16 activations on paths that round them to BF16 get at least BF16_DOT."""
    return max(bound, BF16_DOT) if kernels in ("avx512_bf16", "amx") and bf16_activations else bound


# dw[t, k] = <p, h> of one routed row is a dot product over I whose terms cancel: its relative error is its
# terms' error times Σ|p·h| / |Σ p·h|, about sqrt(I) for random signs and more for an unlucky row, and with a
# handful of rows nothing averages it out. On the tile products, FP8/INT4 weights rounded to BF16 put one
# rounding into p and h each. That rounding alone (the float64 reference rerun on the dequantized weights rounded to BF16, which
# test_quantized_parity repeats), at T=3, I=64 (its experts_without_tokens shape), INT4: over 40 case seeds
# median 2.8e-3, max 2.4e-2 (seed 0, the test's own); over 40 LoRA A draws with seed 0's weights median 8.8e-3,
# max 1.8e-2. So BF16_DOT's 1e-2 failed 9 of 37 runs of the GPU machine's tile tests while LoRA A came from the
# global RNG. Every other output stayed under 3.3e-3 on every quantized parity shape. 5e-2 is twice the worst.
BF16_DOT_DW = 5e-2


def for_quantized_kernels(kernels: str, bound: float, bf16_activations: bool):
    """for_kernels' bound for FP8/INT4 weights; on the tile products (amx, avx512_bf16) with BF16 activations
    dw gets BF16_DOT_DW (a dict of bounds by output name, "*" for the rest)."""
    b = for_kernels(kernels, bound, bf16_activations)
    return {"*": b, "dw": BF16_DOT_DW} if kernels in ("amx", "avx512_bf16") and bf16_activations else b


def rel_l2(a, ref) -> float:
    a = a.detach().double()
    ref = ref.detach().double()
    denom = ref.norm().item()
    return (a - ref).norm().item() / (denom if denom > 0 else 1.0)

# Five AdamW steps of a tiny model, engine vs stock model + reference experts, all float32: per-step
# gradients differ by ~1e-7 (FP32_IO-level arithmetic differences); Adam divides by sqrt(v), which keeps
# relative differences of the gradients as relative differences of the updates (for gradient elements well above
# its eps, which the parity tests set to 1e-6: test_peft_parity.train_alike), and 5 steps compound
# them a few times: 1e-5 on losses and LoRA weights leaves a 10x margin over what was measured (~1e-6).
TRAIN_STEPS = 1e-5

# The same float32 step with attention on CUDA vs on the CPU: cuBLAS/cuDNN reduce in other orders and
# fused attention kernels round differently (TF32 stays off), ~1e-5 relative per op; through a 2-layer
# model and its backward, 1e-3 bounds it with margin.
GPU_VS_CPU = 1e-3

# Logits of a tiny model with its expert LoRA merged into the BF16 expert weights vs applied unmerged: each
# merged weight is rounded once to BF16 (RMS relative error 2^-9/sqrt(3) = 1.1e-3), which the layers carry
# and add up. Measured on the tiny qwen3_moe, deepseek_v3, mixtral and glm4_moe models (test_peft_parity's
# adapter, init_lora_weights=False): 4.1e-3, 3.7e-3, 5.1e-3, 2.5e-3; 1e-2 is twice the worst.
MERGED_BF16 = 1e-2

# Loss under bf16 autocast on the GPU vs float32: bf16 keeps 8 mantissa bits (2^-9 = 2e-3 per rounding) and
# a forward rounds at every matmul input; 2e-2 of the loss value is ~10 such roundings in the same direction.
AUTOCAST_LOSS = 2e-2
