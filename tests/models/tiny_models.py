"""Tiny random-initialized transformers MoE models of each supported architecture (no hub access)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kt_sft.loader.model import model_class

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, hidden_act="silu", tie_word_embeddings=False)

GRANITE_SCALES = dict(embedding_multiplier=4.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.25)

# Gemma 4 26B-A4B's layer: a dense MLP, then the router and GeGLU experts; sliding, then full attention.
GEMMA4_TEXT = dict(**{k: v for k, v in COMMON.items() if k != "hidden_act"}, head_dim=16, global_head_dim=16,
                   intermediate_size=96, moe_intermediate_size=40, num_experts=8, top_k_experts=2,
                   enable_moe_block=True, hidden_size_per_layer_input=0, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"])

# Gemma 4 26B-A4B as published: the whole model with its vision tower (tiny; its o_proj is no nn.Linear, which the
# parity tests' LoRA targets would reach).
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=96,
                                                      moe_intermediate_size=40, num_experts=8,
                                                      num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=40, num_local_experts=6,
                                                  num_experts_per_tok=2),
    "hy_v3": lambda: transformers.HYV3Config(**COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=40,
                                             num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                                             mlp_layer_types=["dense", "sparse"]),
    "phimoe": lambda: transformers.PhimoeConfig(**COMMON, intermediate_size=40, num_local_experts=6,
                                                num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=40,
                                                     shared_expert_intermediate_size=48, num_experts=8,
                                                     num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(  # MLA keeps every head's keys: a padding mask needs them
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(  # DeepSeek-V2-Lite's layout: greedy routing, no q LoRA
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.0),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(  # a gated DeltaNet layer, then a gated attention one
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=40, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**COMMON, head_dim=16, intermediate_size=40,
                                                       num_local_experts=8, num_experts_per_tok=2),
    "minimax": lambda: transformers.MiniMaxConfig(  # a lightning (linear) attention layer, then a softmax one
        **COMMON, head_dim=16, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, block_size=4,
        layer_types=["linear_attention", "full_attention"]),
    "mistral4": lambda: transformers.Mistral4Config(  # MLA, softmax scores routed within groups, a dense first layer
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16),
    # Mistral Small 4 as transformers saves it (its BF16 conversions): the Mistral 4 text model above inside Mistral 3's
    # image-text model (a Pixtral vision tower; each 32x32 image 4x4 patches, merged 2x2 into 4 image tokens).
    "mistral3": lambda: transformers.Mistral3Config(
        text_config={**CONFIGS["mistral4"]().to_dict(), "vocab_size": 100},
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, image_size=32, patch_size=8),
        image_token_index=96, spatial_merge_size=2, multimodal_projector_bias=False, vision_feature_layer=-1,
        tie_word_embeddings=False),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=40, num_experts=8, num_experts_per_tok=2),
    "dots1": lambda: transformers.Dots1Config(**COMMON, intermediate_size=96, moe_intermediate_size=40,
                                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                              first_k_dense_replace=1),
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(  # GLM-4.7-Flash: DeepSeek-V3's attention (MLA)
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, mlp_layer_types=["dense", "sparse"]),
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(  # GLM-5: MLA with the sparse attention's indexer
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, mlp_layer_types=["dense", "sparse"], index_topk=4, index_head_dim=16,
        index_n_heads=2),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=40,
                                                            moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                                                            moe_layer_start_index=1),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(**COMMON, head_dim=16, intermediate_size=40,
                                                              num_experts=8, moe_topk=2),
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=40,
                                                       num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                                                       first_k_dense_replace=1),
    "solar_open": lambda: transformers.SolarOpenConfig(**COMMON, head_dim=16, moe_intermediate_size=40,
                                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(**COMMON, intermediate_size=40, num_experts=8,
                                                     num_experts_per_tok=2, pad_token_id=0),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(  # Qwen3.5-MoE's text model, as qwen3_next's
        **COMMON, head_dim=16, moe_intermediate_size=40, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "glm4v_moe": lambda: transformers.Glm4vMoeConfig(  # GLM-4.5V: as qwen3_vl_moe's below, its ids past 96 too
        text_config={**COMMON, "vocab_size": 104, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 40,
                     "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1]}},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, image_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64),
        image_token_id=96, video_token_id=97, image_start_token_id=98, image_end_token_id=99,
        video_start_token_id=100, video_end_token_id=101),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeConfig(  # the whole image-text model, as qwen3_vl_moe's below
        text_config={**COMMON, "vocab_size": 100, "head_dim": 16, "moe_intermediate_size": 40,
                     "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                     "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16),
        image_token_id=96, video_token_id=97, vision_start_token_id=98, vision_end_token_id=99),
    "qwen3_vl_moe": lambda: transformers.Qwen3VLMoeConfig(  # the whole image-text model; ids past the tests' 96
        text_config={**COMMON, "vocab_size": 100, "head_dim": 16, "moe_intermediate_size": 40, "num_experts": 8,
                     "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 3, 3],
                                                                   "mrope_interleaved": True}},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=96, video_token_id=97, vision_start_token_id=98, vision_end_token_id=99),
    # InternVL3.5-30B-A3B's kind: a Qwen3-MoE text model; each 56x56 image 4x4 patches, shuffled into 4 image tokens.
    "internvl": lambda: transformers.InternVLConfig(
        text_config={**COMMON, "model_type": "qwen3_moe", "vocab_size": 100, "head_dim": 16, "intermediate_size": 96,
                     "moe_intermediate_size": 40, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=[56, 56], patch_size=[14, 14]),
        image_token_id=96, downsample_ratio=0.5, projector_hidden_act="gelu", tie_word_embeddings=False),
    # Qwen3-Omni's thinker: text, images and audio; its audio in chunks of 2 * n_window = 100 frames, as published
    # (transformers 5.17 assumes so where it counts audio tokens).
    "qwen3_omni_moe_thinker": lambda: transformers.Qwen3OmniMoeThinkerConfig(
        text_config={**COMMON, "vocab_size": 104, "head_dim": 16, "moe_intermediate_size": 40,
                     "num_experts": 8, "num_experts_per_tok": 2, "rope_parameters": {
                         "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True}},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
                          output_dim=64, n_window=50, n_window_infer=400, downsample_hidden_size=8,
                          max_source_positions=64),
        audio_token_id=96, image_token_id=97, video_token_id=98, audio_start_token_id=99, vision_start_token_id=100,
        vision_end_token_id=101, audio_end_token_id=102),
    "jamba": lambda: transformers.JambaConfig(  # attention, Mamba + experts, attention, Mamba + experts
        **{**COMMON, "num_hidden_layers": 4}, intermediate_size=40, num_experts=6, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
        use_mamba_kernels=False, mamba_d_state=8, mamba_dt_rank=8),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(  # a dense convolution layer, then attention with experts
        **{k: v for k, v in COMMON.items() if k != "hidden_act"}, intermediate_size=96, moe_intermediate_size=40,
        num_experts=8, num_experts_per_tok=2, num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "longcat_flash": lambda: transformers.LongcatFlashConfig(  # 6 routed experts and 2 returning the token itself
        **{k: v for k, v in COMMON.items() if k not in ("num_hidden_layers", "num_key_value_heads")}, num_layers=2,
        num_key_value_heads=4, ffn_hidden_size=96, expert_ffn_hidden_size=40, n_routed_experts=6, zero_expert_num=2,
        moe_topk=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, head_dim=8,
        v_head_dim=16),
    "llama4": lambda: transformers.Llama4Config(  # the whole image-text model; ids past the tests' 96 as qwen3_vl_moe's
        text_config={**COMMON, "vocab_size": 100, "head_dim": 16, "intermediate_size": 40, "intermediate_size_mlp": 96,
                     "num_local_experts": 6, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                     "no_rope_layers": [1, 0], "attention_chunk_size": 16},
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4, projector_input_dim=64, projector_output_dim=64,
                           vision_output_dim=64, pixel_shuffle_ratio=0.5),
        image_token_index=96, boi_token_index=97, eoi_token_index=98),
    "gpt_oss": lambda: transformers.GptOssConfig(  # a sliding-window layer, then a full one; experts with biases
        **COMMON, head_dim=16, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": lambda: transformers.GraniteMoeConfig(  # Granite's multipliers, none 1, as published (3.0-3b-a800m)
        **COMMON, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, **GRANITE_SCALES),
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(**COMMON, intermediate_size=40,
                                                                    num_local_experts=6, num_experts_per_tok=2,
                                                                    shared_intermediate_size=48, **GRANITE_SCALES),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(  # Granite 4.0-H: a Mamba-2 layer, then attention
        **COMMON, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, shared_intermediate_size=48,
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=8, position_embedding_type="nope", **GRANITE_SCALES),
    "nemotron_h": lambda: transformers.NemotronHConfig(  # Nemotron 3 Nano's kinds of layer: Mamba, MoE, attention
        **{k: v for k, v in COMMON.items() if k not in ("hidden_act", "num_hidden_layers")}, head_dim=16,
        layers_block_type=["mamba", "moe", "attention", "moe"], intermediate_size=96, moe_intermediate_size=40,
        moe_shared_expert_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=8,
        use_mamba_kernels=False),
    "gemma4_text": lambda: transformers.Gemma4TextConfig(**GEMMA4_TEXT),
    "gemma4": lambda: transformers.Gemma4Config(text_config=GEMMA4_TEXT),  # the whole model's class, no vision tower
    "afmoe": lambda: transformers.AfmoeConfig(**COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=40,
                                              num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                                              num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=8),
}


def tiny_model(model_type: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 model whose expert weights are rounded to BF16 (the engine's storage), so the stock model
    and the CPU engine compute on identical weights."""
    torch.manual_seed(seed)
    config = CONFIGS[model_type]()
    model = experts_rounded_to_bf16(model_class(config).from_config(config, dtype=torch.float32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:  # deepseek/glm/minimax: make the bias matter
                p.normal_(0, 0.1)
            if name.endswith("experts.gate_up_proj_bias"):  # gpt_oss: wide enough that some g and u pass the clamps
                p.normal_(0, 4)
            if name.startswith("audio_tower.") and p.dim() >= 2:  # Qwen3-Omni's thinker: at the default init its
                p.normal_(0, p[0].numel() ** -0.5)  # audio tower's output barely moves with its input (1e-5)
    return model.eval()


def experts_rounded_to_bf16(model):
    """model with its routed experts' weights rounded to BF16 in place (Granite's as input_linear and output_linear,
    transformers 5.6's names for them; Nemotron-H's up_proj, its experts having no gate)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.up_proj", "experts.down_proj",
                              "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")):
                p.copy_(p.bfloat16().float())
    return model


def auto_class(model_type: str):
    """The transformers auto class that loads a model_type's checkpoint (an image-text one for qwen3_vl_moe)."""
    return model_class(CONFIGS[model_type]())


def _text_around(g: torch.Generator, rows: int, *pieces) -> dict:
    """input_ids of `rows` rows made of pieces in turn: random text of the given length (ids below 96, drawn from g
    in order) or the given media token ids (96 and up); labels the ids with the media tokens left out (-100), as
    LLaMA-Factory's are."""
    ids = torch.cat([torch.randint(0, 96, (rows, p), generator=g) if isinstance(p, int)
                     else torch.tensor(p).expand(rows, -1) for p in pieces], 1)
    return dict(input_ids=ids, labels=ids.masked_fill(ids >= 96, -100))


def image_batch(seed: int, rows: int = 2) -> dict:
    """A training batch for the tiny qwen3_vl_moe: each row a 16x16 image (4x4 patches, merged 2x2 into 4 image
    tokens between vision start and end) inside random text; labels skip the image tokens, as LLaMA-Factory's do."""
    g = torch.Generator().manual_seed(seed)
    batch = _text_around(g, rows, 3, [98, 96, 96, 96, 96, 99], 5)
    return dict(**batch, mm_token_type_ids=(batch["input_ids"] == 96).long(),
                pixel_values=torch.randn(16 * rows, 3 * 2 * 4 * 4, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]] * rows))


def internvl_batch(seed: int, rows: int = 2) -> dict:
    """A training batch for the tiny InternVL: each row a 56x56 image (4 image tokens between <img> and </img>, ids
    98 and 99) inside random text; labels skip the image tokens."""
    g = torch.Generator().manual_seed(seed)
    return dict(**_text_around(g, rows, 3, [98, 96, 96, 96, 96, 99], 5),
                pixel_values=torch.randn(rows, 3, 56, 56, generator=g))


def mistral3_batch(seed: int, rows: int = 2) -> dict:
    """A training batch for the tiny Mistral 3 (Mistral Small 4): each row a 32x32 image (4 image tokens, then the
    image end token, id 97) inside random text; labels skip the image tokens."""
    g = torch.Generator().manual_seed(seed)
    return dict(**_text_around(g, rows, 3, [96, 96, 96, 96, 97], 5),
                pixel_values=torch.randn(rows, 3, 32, 32, generator=g), image_sizes=torch.tensor([[32, 32]] * rows))


def omni_batch(seed: int, rows: int = 2) -> dict:
    """A training batch for the tiny Qwen3-Omni thinker: each row a 16x16 image (4 image tokens between vision start
    and end) and 32 frames of 16 mel bins (4 audio tokens between audio start and end) inside random text; labels skip
    the media tokens."""
    g = torch.Generator().manual_seed(seed)
    return dict(**_text_around(g, rows, 3, [100, 97, 97, 97, 97, 101], 2, [99, 96, 96, 96, 96, 102], 4),
                pixel_values=torch.randn(16 * rows, 3 * 2 * 4 * 4, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]] * rows), input_features=torch.randn(rows, 16, 32, generator=g),
                feature_attention_mask=torch.ones(rows, 32, dtype=torch.int64))


# What a Qwen3-Omni Instruct checkpoint holds beside its thinker (a few of the talker's and vocoder's tensors).
OMNI_SPEECH = {"talker.model.layers.0.mlp.experts.0.gate_proj.weight": torch.ones(8, 16),
               "talker.model.layers.0.mlp.shared_expert.gate_proj.weight": torch.ones(8, 16),
               "code2wav.code_embedding.weight": torch.ones(8, 16)}


def qwen3_omni_published(path) -> transformers.PreTrainedModel:
    """The tiny Qwen3-Omni thinker saved as Qwen3-Omni Instruct is published: config.json of the whole model
    (model_type qwen3_omni_moe, the thinker's config as thinker_config beside the talker's), the thinker's weights
    under `thinker.` (experts per expert) beside the talker's and the vocoder's. Returns the stock thinker."""
    import json

    from safetensors.torch import load_file, save_file
    model = tiny_model("qwen3_omni_moe_thinker")
    save_checkpoint(model, path)
    state = {f"thinker.{k}": v for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    save_file({**state, **OMNI_SPEECH}, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
              "enable_audio_output": True, "thinker_config": model.config.to_dict(),
              "talker_config": {"model_type": "qwen3_omni_moe_talker", "thinker_hidden_size": 64}}
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    return model


def image_batch_of(model_type: str):
    """The batches with images of the tiny model_type (image_batch's grids are Qwen's and GLM's)."""
    return {"internvl": internvl_batch, "mistral3": mistral3_batch}.get(model_type, image_batch)


def _published(model_type: str, path, transposed: bool = False, **extra) -> transformers.PreTrainedModel:
    """The tiny model_type saved with its weights under the module tree's names, each layer's experts fused (as the
    module holds them, or transposed), whatever layout this transformers version's save_pretrained writes (5.17's
    splits them per expert), with `extra` tensors beside them. Returns the stock model."""
    from safetensors.torch import save_file
    model = tiny_model(model_type)
    save_checkpoint(model, path)
    state = {k: v.transpose(1, 2) if transposed and k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
             for k, v in model.state_dict().items()}
    for old in Path(path).glob("model*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in {**state, **extra}.items()}, str(Path(path) / "model.safetensors"),
              metadata={"format": "pt"})
    return model


def qwen3_vl_moe_published(path) -> transformers.PreTrainedModel:
    """The tiny qwen3_vl_moe saved as Qwen3-VL-MoE is published: each layer's experts fused and transposed
    (gate_up_proj [E, H, 2I], down_proj [E, I, H])."""
    return _published("qwen3_vl_moe", path, transposed=True)


def qwen3_5_moe_published(path) -> transformers.PreTrainedModel:
    """The tiny qwen3_5_moe saved as Qwen3.5-MoE is published: the whole image-text model, each layer's experts fused
    as the module holds them, and a multi-token-prediction module (`mtp.*`, which transformers skips) beside them."""
    return _published("qwen3_5_moe", path, **{"mtp.fc.weight": torch.ones(8, 8)})


def save_checkpoint(model: transformers.PreTrainedModel, path) -> None:
    """model.save_pretrained(path), with a stand-in for the tokenizer files that `kt-sft prepare` requires."""
    model.save_pretrained(path)
    (Path(path) / "tokenizer_config.json").write_text("{}")
