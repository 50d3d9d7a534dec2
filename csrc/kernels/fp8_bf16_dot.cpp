// FP8 rows off the tiles on vdpbf16ps with byte table lookups (quantized_bf16_dot.h): compiled with AVX-512 VBMI,
// which the sets with AVX-512 BF16 call only where CPUID has it.
#define KT_FP8_BF16_DOT  // quantized_bf16_dot.h: the FP8 codec, not the sets' wiring
#include "simd_avx512.h"
#include "kernel_body.h"
#include "quantized_bf16_dot.h"

namespace kt {
void gemm_nt_fp8_bf16_dot(const GemmNT<fp8_block>& g) { gemm_nt_bf16_dot_rows<Fp8Steps>(g); }
}  // namespace kt
