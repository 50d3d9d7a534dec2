"""NVIDIA Nemotron-H MoE (model_type nemotron_h: Nemotron 3 Nano 30B-A3B and its kin): Mamba-2 layers, attention
layers and MoE layers in the order its config's layers_block_type gives, Mamba, attention, router and shared expert
on the GPU as transformers runs them. Its routed experts have no gate: up, relu², down (the engine's RELU2 unit),
published per expert under backbone.layers.{L}.mixer.experts.{e}, which transformers names model.layers.{L}. A
config with moe_latent_size runs the experts in that latent width (the engine's H), between the block's own
projections in and out of it on the GPU."""
from ..ops.reference import RELU2
from .registry import MoEArchitecture, register

register(MoEArchitecture(
    "nemotron_h", experts_classes=("NemotronHExperts",),
    checkpoint_experts="backbone.layers.{layer}.mixer.experts.{expert}.{proj}.weight",
    checkpoint_projections=(None, "up_proj", "down_proj"),
    # The published name of the embeddings is backbone.embeddings (transformers 5.17 saves it so); 5.6 saves
    # backbone.embedding, read too.
    key_renames=(("backbone.", "model."), ("embedding.weight", "embeddings.weight")),
    shared_experts="shared_experts",
    unit=RELU2, activation_field="mlp_hidden_act", activations=("relu2",),
))
