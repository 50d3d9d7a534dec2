"""IBM Granite MoE: granitemoe (Granite 3.0 / 3.1 MoE), granitemoeshared (with a shared MLP) and granitemoehybrid
(Granite 4.0-H: Mamba-2 layers between attention ones, each with routed experts and a shared MLP). Attention, Mamba,
router and shared MLP run on the GPU as transformers runs them.

The stock MoE block holds its experts as two modules beside its router, input_linear [E, 2I, H] (gate's rows first)
and output_linear [E, H, I], each an `nn.Parameter` called per expert, where transformers 5 holds other models' as
one experts module called with the routing. `hold_experts` gives each block that module (GraniteMoeExperts, the
same parameters), which the engine then replaces as any other's, and the block a forward that calls it. State dicts
keep the stock names (`block_sparse_moe.input_linear.weight`), as the checkpoints publish them fused: a save loads
in stock transformers, and a stock save or checkpoint loads into the engine."""
import types

import torch
from torch import nn

from .registry import MoEArchitecture, register

# The stock MoE block classes, and their experts' stock names -> the names under the experts module.
BLOCKS = ("GraniteMoeMoE", "GraniteMoeSharedMoE", "GraniteMoeHybridMoE")
STOCK_NAMES = (("input_linear.weight", "experts.gate_up_proj"), ("output_linear.weight", "experts.down_proj"))


class GraniteMoeExperts(nn.Module):
    """A Granite MoE block's experts as transformers 5 holds other models' (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]): the stock weights, held only until the engine takes them (patch.py, the loader)."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj


def routed_forward(block, hidden_states):
    """The stock block's forward, its experts called with the routing: the stock router's choice (the top_k logits,
    softmax over them, in the input's dtype), each expert's output weighed and summed per token. The stock router
    also sorts the tokens by expert and reads the counts to the host, which the engine's call does not need (on a
    GPU, a wait for the device at every layer)."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    logits = block.router.layer(x).float()
    top_logits, index = logits.topk(block.router.top_k, dim=1)
    weights = torch.softmax(top_logits, dim=1).type_as(x)
    return block.experts(x, index, weights).view(batch, length, hidden)


def _stock_names(block, state_dict, prefix, local_metadata):
    for stock, ours in STOCK_NAMES:
        if prefix + ours in state_dict:
            state_dict[prefix + stock] = state_dict.pop(prefix + ours)


def _our_names(state_dict, prefix, *args):
    for stock, ours in STOCK_NAMES:
        if prefix + stock in state_dict and prefix + ours not in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + stock)


def hold_experts(model: nn.Module) -> None:
    """Gives every stock Granite MoE block of model an experts module (GraniteMoeExperts) and routed_forward."""
    for block in model.modules():
        if type(block).__name__ not in BLOCKS or not hasattr(block, "input_linear"):
            continue
        block.experts = GraniteMoeExperts(block.input_linear.weight, block.output_linear.weight)
        del block.input_linear, block.output_linear
        block.forward = types.MethodType(routed_forward, block)
        block._register_state_dict_hook(_stock_names)
        block._register_load_state_dict_pre_hook(_our_names)


for model_type, dense_beside in (("granitemoe", None), ("granitemoeshared", "shared_mlp"),
                                 ("granitemoehybrid", "shared_mlp")):
    register(MoEArchitecture(
        model_type, experts_classes=("GraniteMoeExperts",), restructure=hold_experts,
        checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        key_renames=tuple((f"block_sparse_moe.{stock}", f"block_sparse_moe.{ours}") for stock, ours in STOCK_NAMES),
        dense_beside=dense_beside,
    ))
