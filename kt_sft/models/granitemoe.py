"""IBM Granite MoE: granitemoe (Granite 3.0 / 3.1 MoE), granitemoeshared (with a shared MLP) and granitemoehybrid
(Granite 4.0-H: Mamba-2 layers between attention ones, each with routed experts and a shared MLP). Attention, Mamba,
router and shared MLP run on the GPU as transformers runs them.

The checkpoints publish each layer's experts fused as input_linear [E, 2I, H] (gate's rows first) and output_linear
[E, H, I], and the router as router.layer. Transformers from 5.17 (at least; not 5.6) holds them as other models'
experts (`GraniteMoeExperts` with gate_up_proj and down_proj, called with the routing; the router as router.weight),
renaming the keys at load and back at save. Transformers 5.6's block holds them as two modules beside its router,
each a parameter called per expert: `hold_experts` gives each such block an experts module of the same parameters
(StockGraniteExperts), which the engine then replaces as any other's, and the block a forward that calls it; its
state dicts keep the stock names, so a save loads in stock transformers, and a stock save loads into the engine."""
import types

import torch
import transformers.models.granitemoe.modeling_granitemoe as stock_granite
from torch import nn

from .registry import MoEArchitecture, register

# The stock MoE block classes, and their experts' stock names -> the names under the experts module.
BLOCKS = ("GraniteMoeMoE", "GraniteMoeSharedMoE", "GraniteMoeHybridMoE")
STOCK_NAMES = (("input_linear.weight", "experts.gate_up_proj"), ("output_linear.weight", "experts.down_proj"))


class StockGraniteExperts(nn.Module):
    """A transformers 5.6 Granite MoE block's experts as transformers 5 holds other models' (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]): the stock weights, held only until the engine takes them (patch.py, the loader)."""

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
    """Gives every transformers 5.6 Granite MoE block of model an experts module (StockGraniteExperts) and
    routed_forward (a block of a later transformers holds one already)."""
    for block in model.modules():
        if type(block).__name__ not in BLOCKS or not hasattr(block, "input_linear"):
            continue
        block.experts = StockGraniteExperts(block.input_linear.weight, block.output_linear.weight)
        del block.input_linear, block.output_linear
        block.forward = types.MethodType(routed_forward, block)
        block._register_state_dict_hook(_stock_names)
        block._register_load_state_dict_pre_hook(_our_names)


# The checkpoints' names of the experts and, where this transformers has renamed it, the router (module names last).
RENAMES = (*((f"block_sparse_moe.{stock}", f"block_sparse_moe.{ours}") for stock, ours in STOCK_NAMES),
           *((("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),)
             if hasattr(stock_granite, "GraniteMoeTopKRouter") else ()))

for model_type, classes, dense_beside in (("granitemoe", "GraniteMoe", None),
                                          ("granitemoeshared", "GraniteMoeShared", "shared_mlp"),
                                          ("granitemoehybrid", "GraniteMoeHybrid", "shared_mlp")):
    register(MoEArchitecture(
        model_type, experts_classes=(f"{classes}Experts", "StockGraniteExperts"), restructure=hold_experts,
        checkpoint_experts="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        key_renames=RENAMES, dense_beside=dense_beside,
    ))
