"""Qwen3-Omni (Qwen3-Omni-30B-A3B Instruct, Thinking, Captioner; model_type qwen3_omni_moe): a thinker (a Qwen3-MoE
text model with a vision tower and an audio tower: text, images, audio and video in, text out) beside a talker and a
vocoder that speak its answers (Instruct only). kt_sft serves the thinker, as LLaMA-Factory trains it (it loads the
whole model, then keeps `.thinker`): `kt-sft prepare` writes the thinker's config (model_type
qwen3_omni_moe_thinker) and reads the weights under `thinker.`; the talker's are not read. Experts per expert, as
published (thinker.model.layers.N.mlp.experts.E.gate_proj.weight)."""
from .registry import Composite, MoEArchitecture, register, register_composite

register(MoEArchitecture("qwen3_omni_moe_thinker", experts_classes=("Qwen3OmniMoeThinkerTextExperts",)))
register_composite("qwen3_omni_moe", Composite("thinker.", config_key="thinker_config", attribute="thinker",
                                               per_expert_export=True))
