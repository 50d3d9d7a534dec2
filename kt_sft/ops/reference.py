"""THE pure-PyTorch reference of the routed experts (DESIGN.md §4), used by every test and benchmark.

Legend: T tokens, H hidden, I intermediate, E experts, K top-k, r LoRA rank.
Per expert e, with s the LoRA scale:
    g = x Wgᵀ + s (x Agᵀ) Bgᵀ + bg,  u = x Wuᵀ + s (x Auᵀ) Buᵀ + bu,  h = glu(g, u),  y = h Wdᵀ + s (h Adᵀ) Bdᵀ + bd
    out[t] = Σ_k w[t,k] · y_{e(t,k)}[t]
with the biases optional (GPT-OSS has them) and glu silu(g)·u, or GPT-OSS's clamped form (Glu). Experts without a
gate (Nemotron-H's) have no g: h = relu(u)², and gate_up holds up's rows alone.
Autograd through this function gives the reference gradients of x, w, every LoRA A/B and the base weights.
Computed in the dtype of its inputs (tests use float64).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

PROJECTIONS = ("gate", "up", "down")


class Glu(NamedTuple):
    """The experts' gated unit: h = g'·sigmoid(alpha·(g' + cubic·g'³))·(u' + up_offset), g' = min(g, limit), u' = u
    clamped to ±limit (csrc/kernels/kernels.h). The defaults are SwiGLU, silu(g)·u. Not gated: h = relu(u)²
    (transformers' relu2), the other fields unused."""

    alpha: float = 1.0
    limit: float = math.inf
    up_offset: float = 0.0
    cubic: float = 0.0
    gated: bool = True

    @property
    def stacked(self) -> int:
        """Projections in gate_up per expert: gate's and up's rows, or up's alone."""
        return 2 if self.gated else 1


SWIGLU = Glu()
GPT_OSS_GLU = Glu(alpha=1.702, limit=7.0, up_offset=1.0)  # transformers' GptOssExperts
# GeGLU with the tanh-approximated gelu (gelu_pytorch_tanh: Gemma 4): 0.5·(1 + tanh(z)) = sigmoid(2z).
GEGLU_TANH = Glu(alpha=2.0 * math.sqrt(2.0 / math.pi), cubic=0.044715)
RELU2 = Glu(gated=False)  # Nemotron-H's experts: up, relu², down


def glu(g: torch.Tensor, u: torch.Tensor, f: Glu = SWIGLU) -> torch.Tensor:
    """The gated unit as torch computes it: torch's own silu and tanh-approximated gelu where the unit is one of
    those (the engine's sigmoid form of the latter is checked against torch's tanh form). g is unused (None) where the
    unit has no gate."""
    if not f.gated:
        return torch.square(F.relu(u))
    if f == SWIGLU:
        return F.silu(g) * u
    if f == GEGLU_TANH:
        return F.gelu(g, approximate="tanh") * u
    # The clamps pass no gradient at the limit itself, as the engine: torch 2.14's clamp does the same, torch 2.11's
    # passes it (a value exactly at the limit is the only difference between them).
    g = torch.where(g < f.limit, g, g.clamp(max=f.limit).detach())
    u = torch.where(u.abs() < f.limit, u, u.clamp(-f.limit, f.limit).detach())
    return g * torch.sigmoid(f.alpha * g * (1 + f.cubic * g * g)) * (u + f.up_offset)


class LoraWeights(NamedTuple):
    """Stacked LoRA of one layer's experts: A[p] [E, r, in_p], B[p] [E, out_p, r] (or lists of E per-expert
    matrices); None where absent. With
    dropout > 0, A sees its input times lora_dropout_keep(seed, ...) (training)."""

    A: dict
    B: dict
    scale: float
    dropout: float = 0.0
    seed: int = 0


_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values (products wrap, low 32 bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def lora_dropout_keep(seed: int, proj: int, rows: torch.Tensor, cols: int, p: float) -> torch.Tensor:
    """The engine's LoRA dropout mask (csrc/moe/lora_dropout.h) times 1 / (1 − p), float64 [len(rows), cols]:
    rows are the routed copies' t·K + k, proj 0/1/2 for gate/up/down."""
    key = _fmix32(torch.tensor((seed ^ ((proj * 0x9E3779B9) & _M32)) & _M32, dtype=torch.int64))
    row_key = _fmix32(key ^ rows.to(torch.int64))
    h = _fmix32(row_key[:, None] ^ torch.arange(cols, dtype=torch.int64)[None, :])
    u = (h >> 8).to(torch.float64) / 2**24
    p32 = torch.tensor(p, dtype=torch.float32).item()  # the engine compares against p in float32
    return (u >= p32).to(torch.float64) / (1 - p32)


def lora_scale(r: int, alpha: float, use_rslora: bool = False) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def moe_experts_reference(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    lora: LoraWeights | None = None,
    identity_experts: int = 0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    unit: Glu = SWIGLU,
) -> torch.Tensor:
    """x [T,H], top_k_index [T,K], top_k_weights [T,K], gate_up [E,2I,H] (gate rows first; [E,I,H], up's alone,
    for a unit without a gate), down [E,H,I], gate_up_bias [E,2I] (gate's first; [E,I] without a gate), down_bias
    [E,H]. Ids E to E + identity_experts - 1 are zero-computation experts (LongCat-Flash): each returns its token; id
    -1 is no expert (adds nothing)."""
    E, stacked_rows, _ = gate_up.shape
    inter = stacked_rows // unit.stacked
    up_rows = slice(stacked_rows - inter, stacked_rows)  # up's rows: the second half, or all without a gate
    out = torch.zeros_like(x)
    for e in range(E):
        tok, kk = torch.nonzero(top_k_index == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        routed = tok * top_k_index.shape[1] + kk  # each routed copy's t·K + k (its dropout stream)

        def projected(proj: str, rows: slice) -> torch.Tensor:
            y = xe @ gate_up[e, rows].T
            if lora is not None:
                y = y + _lora(lora, proj, e, xe, routed)
            return y if gate_up_bias is None else y + gate_up_bias[e, rows]

        g = projected("gate", slice(0, inter)) if unit.gated else None
        u = projected("up", up_rows)
        h = glu(g, u, unit)
        y = h @ down[e].T
        if lora is not None:
            y = y + _lora(lora, "down", e, h, routed)
        if down_bias is not None:
            y = y + down_bias[e]
        out.index_add_(0, tok, y * top_k_weights[tok, kk].unsqueeze(-1))
    identity = (top_k_index >= E) & (top_k_index < E + identity_experts)
    return out + (top_k_weights * identity).sum(-1, keepdim=True) * x


def _lora(lora: LoraWeights, proj: str, e: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    A, B = lora.A.get(proj), lora.B.get(proj)
    if A is None:
        return torch.zeros((), dtype=x.dtype)
    if lora.dropout > 0:
        x = x * lora_dropout_keep(lora.seed, PROJECTIONS.index(proj), rows, x.shape[1], lora.dropout).to(x.dtype)
    return lora.scale * ((x @ A[e].T) @ B[e].T)


class ReferenceExperts(torch.nn.Module):
    """The reference as a transformers 5.x experts module (same call), with optional stacked LoRA.

    Used by model-level parity tests as the stock model's experts carrying the same LoRA in plain PyTorch.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, lora_A: dict | None = None,
                 lora_B: dict | None = None, scale: float = 0.0, identity_experts: int = 0,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, unit: Glu = SWIGLU):
        super().__init__()
        self.identity_experts, self.unit = identity_experts, unit
        self.gate_up_bias = None if gate_up_bias is None else torch.nn.Parameter(gate_up_bias)
        self.down_bias = None if down_bias is None else torch.nn.Parameter(down_bias)
        self.gate_up_proj = torch.nn.Parameter(gate_up)
        self.down_proj = torch.nn.Parameter(down)
        self.lora_A = torch.nn.ParameterDict({p: torch.nn.Parameter(t) for p, t in (lora_A or {}).items()})
        self.lora_B = torch.nn.ParameterDict({p: torch.nn.Parameter(t) for p, t in (lora_B or {}).items()})
        self.scale = scale

    def forward(self, hidden_states, top_k_index, top_k_weights):
        lora = LoraWeights(dict(self.lora_A), dict(self.lora_B), self.scale) if len(self.lora_A) else None
        w = top_k_weights.to(hidden_states.dtype)
        dt = hidden_states.dtype
        biases = (None if b is None else b.to(dt) for b in (self.gate_up_bias, self.down_bias))
        return moe_experts_reference(hidden_states, top_k_index, w, self.gate_up_proj.to(dt), self.down_proj.to(dt),
                                     lora, self.identity_experts, *biases, self.unit)
