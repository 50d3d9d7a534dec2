"""Builds one routed-experts case: random BF16 experts, routing, LoRA, and the float64 reference grads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kt_sft
from kt_sft.formats import QuantizedExperts
from kt_sft.ops.reference import GPT_OSS_GLU, SWIGLU, Glu, LoraWeights, moe_experts_reference


@dataclass(frozen=True)
class Shape:
    name: str  # the edge it covers
    T: int
    H: int
    I: int
    E: int
    K: int
    r: int = 8
    routing: str = "random"  # random: K distinct experts per token; one: every token on expert 0; few: experts 0..K-1


def make_routing(shape: Shape, gen: torch.Generator) -> torch.Tensor:
    T, E, K = shape.T, shape.E, shape.K
    if shape.routing == "one":
        return torch.zeros(T, K, dtype=torch.int64)
    if shape.routing == "few":
        return torch.arange(K).repeat(T, 1)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K,
                                                                                                        dtype=torch.int64)


def make_module(shape: Shape, lora: bool, train_base: bool = False, seed: int = 0,
                expert_format: str = "bf16", identity_experts: int = 0, gpt_oss: bool = False,
                unit: Glu | None = None) -> kt_sft.KTExperts:
    """Random experts in BF16, or quantized to "fp8" / "int4" from the same random values ("fp8_rows": FP8 with
    blocks one row high, the grid of a scale per output channel). gpt_oss: with biases
    and GPT-OSS's clamped unit; the gate/up bias spread wide enough (σ 4) that many g and u pass the clamps (±7).
    unit: another unit than SwiGLU (GEGLU_TANH, or RELU2 without a gate: up's rows alone)."""
    gen = torch.Generator().manual_seed(seed)
    E, H, I = shape.E, shape.H, shape.I
    gu = (torch.randn(E, (unit or SWIGLU).stacked * I, H, generator=gen) / H**0.5).bfloat16()
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    kwargs = dict(train_base=train_base, identity_experts=identity_experts)
    if gpt_oss:
        kwargs.update(gate_up_proj_bias=(4 * torch.randn(E, 2 * I, generator=gen)).bfloat16(),
                      down_proj_bias=torch.randn(E, H, generator=gen).bfloat16(), unit=GPT_OSS_GLU)
    if unit is not None:
        kwargs["unit"] = unit
    if expert_format == "bf16":
        m = kt_sft.KTExperts(gu, dn, **kwargs)
    else:
        fmt, rows = ("fp8", 1) if expert_format == "fp8_rows" else (expert_format, 128)
        m = kt_sft.KTExperts(QuantizedExperts.quantize(fmt, gu, dn, (unit or SWIGLU).gated, rows), **kwargs)
    if lora:
        m.add_lora(shape.r, alpha=2.0 * shape.r)
        with torch.no_grad():  # A drawn here too (add_lora's init uses the global RNG, which differs between runs
            for p in m.lora_A["default"].values():  # of the suite), and non-zero B so every LoRA path contributes
                p.uniform_(-1, 1, generator=gen).mul_(p.shape[-1] ** -0.5)
            for p in m.lora_B["default"].values():
                p.normal_(0, 0.05, generator=gen)
    return m


def inputs(shape: Shape, dtype=torch.float32, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.T, shape.H, generator=gen).to(dtype)
    idx = make_routing(shape, gen)
    w = torch.rand(shape.T, shape.K, generator=gen)
    gout = torch.randn(shape.T, shape.H, generator=gen).to(dtype)
    return x, idx, w, gout


def lora_of(m: kt_sft.KTExperts):
    """The active adapter's (A, B) dicts by projection, empty without LoRA."""
    ad = m.active_lora()
    return (m.lora_A[ad], m.lora_B[ad]) if ad else ({}, {})


def run_engine(m: kt_sft.KTExperts, x, idx, w, gout):
    """Output and every gradient from the engine, as a dict of tensors: copies, since LoRA grads land in
    buffers the module reuses on its next backward (KTExperts.lora_grad_into)."""
    for p in m.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = m(x, idx, w)
    y.backward(gout)
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    for p, a in lora_of(m)[0].items():
        out[f"dA_{p}"] = a.grad
        out[f"dB_{p}"] = lora_of(m)[1][p].grad
    if m.gate_up_proj.requires_grad:
        out["d_gate_up"] = m.gate_up_proj.grad
        out["d_down"] = m.down_proj.grad
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        bias = getattr(m, name)
        if bias is not None and bias.requires_grad:
            out["d_" + name] = bias.grad
    return {k: None if v is None else v.clone() for k, v in out.items()}


def run_reference(m: kt_sft.KTExperts, x, idx, w, gout):
    """The same quantities from autograd through the float64 reference."""
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    gu, dn = m.base_weights()
    gu, dn = gu.detach().double().requires_grad_(), dn.detach().double().requires_grad_()
    A0, B0 = lora_of(m)
    A = {p: t.detach().double().requires_grad_() for p, t in A0.items()}
    B = {p: t.detach().double().requires_grad_() for p, t in B0.items()}
    lora = LoraWeights(A, B, m.scaling[m.active_lora()]) if A else None
    biases = {name: None if getattr(m, name) is None else getattr(m, name).detach().double().requires_grad_()
              for name in ("gate_up_proj_bias", "down_proj_bias")}
    y = moe_experts_reference(xd, idx, wd, gu, dn, lora, m.identity_experts, *biases.values(), m.unit)
    leaves = [xd, wd, gu, dn, *A.values(), *B.values(), *(b for b in biases.values() if b is not None)]
    if y.requires_grad:
        y.backward(gout.double())
    for t in leaves:  # with no tokens nothing depends on the leaves: their grads are zero
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    out = {"y": y.detach(), "dx": xd.grad, "dw": wd.grad}
    for p in A:
        out[f"dA_{p}"] = A[p].grad
        out[f"dB_{p}"] = B[p].grad
    if m.gate_up_proj.requires_grad:
        out["d_gate_up"] = gu.grad
        out["d_down"] = dn.grad
    for name, bias in biases.items():
        if bias is not None and getattr(m, name).requires_grad:
            out["d_" + name] = bias.grad
    return out
