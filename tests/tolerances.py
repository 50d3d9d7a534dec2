"""The one tolerance table (STYLE.md 9): relative L2 error bounds against the float64 reference.

rel_l2(a, ref) = ||a - ref|| / ||ref||. The reference runs in float64 on exactly the engine's BF16 weight
values, so weight storage adds no error; what remains is the engine's own arithmetic.
"""

# float32 activations in and out. The engine accumulates in float32 (unit roundoff u = 6e-8); a
# reduction of length n has error growing like sqrt(n)·u for random signs, and the longest chain here
# (backward dW over tokens, forward over H) is a few thousand terms: ~3e-6. silu's exp is a degree-6
# polynomial (≤ 2 ulp). 2e-5 leaves a ~5x margin for the products of several such steps.
FP32_IO = 2e-5

# bfloat16 activations in and out: every output element is rounded once to 8 mantissa bits
# (relative error ≤ 2^-9 = 2e-3, RMS ~1.1e-3 for uniform rounding); inputs are exact bf16 values.
# dx and outputs carry that one rounding; 4e-3 is twice the worst single rounding.
BF16_IO = 4e-3

# Base-weight grads accumulated into BF16 param.grad: one rounding per accumulation, as above.
BF16_GRAD = 4e-3

# The float64 reference itself against float32 autograd of the same formula is not used: every
# comparison is against float64.


def rel_l2(a, ref) -> float:
    a = a.detach().double()
    ref = ref.detach().double()
    denom = ref.norm().item()
    return (a - ref).norm().item() / (denom if denom > 0 else 1.0)
