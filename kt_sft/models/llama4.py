"""Llama 4 (Scout 17B-16E, Maverick 17B-128E; model_type llama4): served whole (transformers'
Llama4ForConditionalGeneration: the vision tower, attention, router and shared expert on the GPU). Its experts are
held and published fused and transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]). The stock MoE block scales
each token by its routing weight (the sigmoid of its top router logit) and runs every expert on every token, the
unrouted ones on zeros; here the block gives the engine each token scaled by its weight, routed to its expert with
weight 1, then adds the shared expert as the stock block does."""
import torch

from .registry import MoEArchitecture, register


def scaled_input_forward(block, hidden_states):
    """Llama4TextMoe's forward, its experts on the engine: Σ_k expert_k(x · s_k) + shared_expert(x) over the top_k
    experts of each token. The engine weighs its experts' outputs, not their inputs, so it gets each token's top_k
    scaled copies as rows of their own, each routed to its one expert with weight 1: one call (gradient
    checkpointing's recompute then finds that call's first pass kept)."""
    x = hidden_states.reshape(-1, block.hidden_dim)
    scores, logits = block.router(x)
    index = torch.topk(logits, block.top_k, dim=1).indices  # the router's own choice
    weight = scores.gather(1, index)
    copies = (weight.T.unsqueeze(-1) * x).reshape(-1, x.shape[-1])  # [top_k · T, H], copy k of every token first
    ones = torch.ones(copies.shape[0], 1, dtype=torch.float32, device=x.device)
    routed = block.experts(copies, index.T.reshape(-1, 1), ones).view(block.top_k, *x.shape).sum(0)
    return block.shared_expert(x) + routed, logits


register(MoEArchitecture(
    "llama4", experts_classes=("Llama4TextExperts",),
    checkpoint_experts="language_model.model.layers.{layer}.feed_forward.experts.{expert}.{proj}.weight",
    fused_transposed=True, module_transposed=True, block_forward=scaled_input_forward,
    shared_experts="shared_expert",
))
