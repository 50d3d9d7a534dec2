"""A tiny Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V, Llama 4, Gemma 4, Qwen3-Omni, InternVL3.5 or Mistral Small 4 as published
(no hub access): config, weights (Qwen's experts fused, Qwen3-VL-MoE's transposed; GLM's, Qwen3-Omni's and InternVL's
per expert), a byte-level tokenizer holding the model's special tokens, its image and video processors and chat
template; and a dataset of coloured images to ask about, in LLaMA-Factory's multimodal sharegpt format."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Qwen3-VL's special tokens in its vocabulary's order, at ids 256 on (after the 256 byte tokens).
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
EXTRA = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = namespace(s='') %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}"
    "{%- set content.s = content.s + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif item['type'] == 'video' %}"
    "{%- set content.s = content.s + '<|vision_start|><|video_pad|><|vision_end|>' %}"
    "{%- else %}{%- set content.s = content.s + item['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.s %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
PIXELS = 64 * 64  # a 64x64 image: 4x4 patches of 16 pixels, merged 2x2 into 4 image tokens


# GLM-4.5V's, and its chat format (LLaMA-Factory's glm4_5v template) as a chat template.
GLM_SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
               "<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
               "<|end_of_video|>"]
GLM_EXTRA = ["<think>", "</think>", "<answer>", "</answer>"]
GLM_TEMPLATE = (
    "[gMASK]<sop>{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = namespace(s='') %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{%- set content.s = content.s + '<|begin_of_image|><|image|><|end_of_image|>' %}"
    "{%- elif item['type'] == 'video' %}"
    "{%- set content.s = content.s + '<|begin_of_video|><|video|><|end_of_video|>' %}"
    "{%- else %}{%- set content.s = content.s + item['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.s %}{%- endif %}"
    "{{- '<|' + message['role'] + '|>\n' + content }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}")


def _content_of_message(image: str) -> str:
    """Jinja that sets `content` to a message's text, each image in it written as `image` (for the models whose
    processor expands one token into the image's)."""
    return ("{%- if message['content'] is string %}{%- set content = message['content'] %}"
            "{%- else %}{%- set content = namespace(s='') %}{%- for item in message['content'] %}"
            "{%- if item['type'] == 'image' %}{%- set content.s = content.s + '" + image + "' %}"
            "{%- else %}{%- set content.s = content.s + item['text'] %}{%- endif %}{%- endfor %}"
            "{%- set content = content.s %}{%- endif %}")


# Llama 4's special tokens, and its chat format (LLaMA-Factory's llama4 template) as a chat template: an image is
# <|image|>, which its processor expands into the image's tokens.
LLAMA4_SPECIAL = ["<|end_of_text|>", "<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>",
                  "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                  "<|tile_y_separator|>"]
LLAMA4_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}" + _content_of_message("<|image|>") +
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\n\n' + content + '<|eot|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\n\n' }}{%- endif %}")


def _save(build, out: Path, seed: int, tok, eos: list[int], pad: int, bos: int) -> None:
    """The model build() makes from seed, saved to out with its generation config and tokenizer; its lm_head drawn
    wide enough for LoRA to fit the data, as in the demo."""
    import transformers
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.15)
    model.save_pretrained(out)
    transformers.GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos,
                                  do_sample=False).save_pretrained(out)
    tok.save_pretrained(out)


def _llama4(out: Path, seed: int) -> Path:
    """A tiny Llama 4 (its experts fused and transposed, as the module holds them and as published; a shared expert;
    16x16 image tiles of 4x4 patches, shuffled into 4 image tokens) with its tokenizer and processor."""
    import transformers
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
    tok = _tokenizer(LLAMA4_SPECIAL, [], "<|eot|>", LLAMA4_TEMPLATE)
    tok.bos_token = "<|begin_of_text|>"
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA4_SPECIAL}
    text = dict(vocab_size=288, hidden_size=128, intermediate_size=32, intermediate_size_mlp=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=1,
                interleave_moe_layer_step=1, no_rope_layers=[1, 0], max_position_embeddings=4096,
                tie_word_embeddings=False, eos_token_id=ids["<|eot|>"], bos_token_id=ids["<|begin_of_text|>"],
                pad_token_id=ids["<|end_of_text|>"])
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, projector_input_dim=128, projector_output_dim=128, vision_output_dim=128,
                  pixel_shuffle_ratio=0.5)
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=ids["<|patch|>"],
                                       boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"],
                                       tie_word_embeddings=False)
    _save(lambda: transformers.Llama4ForConditionalGeneration(config), out, seed, tok,
          eos=[ids["<|eot|>"], ids["<|eom|>"]], pad=ids["<|end_of_text|>"], bos=ids["<|begin_of_text|>"])
    images = Llama4ImageProcessor(size={"height": 16, "width": 16}, max_patches=1, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3)
    transformers.Llama4Processor(image_processor=images, tokenizer=tok, patch_size=4, pixel_shuffle_ratio=0.5,
                                 chat_template=LLAMA4_TEMPLATE).save_pretrained(out)
    return out


# Gemma 4's special tokens; those its processor reads by name; its chat format (LLaMA-Factory's gemma4 template) as a
# chat template: an image is <|image|>, which its processor expands into the image's soft tokens.
GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>",
                  "<audio|>", "<|audio|>", "<|video|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>"]
GEMMA4_NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
GEMMA4_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}" + _content_of_message("<|image|>") +
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<|turn>' + role + '\n' + content + '<turn|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\n' }}{%- endif %}")


def _gemma4(out: Path, seed: int) -> Path:
    """A tiny Gemma 4 (26B-A4B's layer: a dense MLP beside GeGLU experts; sliding, then full attention) with its vision
    tower (4x4 patches pooled 3x3: 70 soft tokens at most per image, the fewest its processor allows), tokenizer and
    processor."""
    import transformers
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    tok = _tokenizer(GEMMA4_SPECIAL, [], "<turn|>", GEMMA4_TEMPLATE, pad="<pad>", bos="<bos>", named=GEMMA4_NAMED)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL}
    text = dict(vocab_size=288, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, global_head_dim=32, moe_intermediate_size=32, num_experts=8,
                top_k_experts=2, enable_moe_block=True, hidden_size_per_layer_input=0, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                tie_word_embeddings=False, eos_token_id=ids["<turn|>"], bos_token_id=ids["<bos>"],
                pad_token_id=ids["<pad>"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                                       boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
                                       tie_word_embeddings=False)
    _save(lambda: transformers.AutoModelForImageTextToText.from_config(config), out, seed, tok,
          eos=[ids["<turn|>"], ids["<eos>"]], pad=ids["<pad>"], bos=ids["<bos>"])
    patches = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    transformers.Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), tokenizer=tok,
                                 image_processor=Gemma4ImageProcessor(**patches),
                                 video_processor=Gemma4VideoProcessor(**patches), image_seq_length=70,
                                 chat_template=GEMMA4_TEMPLATE).save_pretrained(out)
    return out


# Qwen3-Omni's audio tokens after Qwen3-VL's, and what its processor reads as the tokenizer's attributes.
OMNI_AUDIO = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
OMNI_NAMED = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
              "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}


def _qwen3_omni(out: Path, seed: int) -> Path:
    """A tiny Qwen3-Omni as published: config.json of the whole model (the thinker's as thinker_config; audio output
    off, as in Thinking and Captioner), the thinker's weights under `thinker.` (experts per expert), its tokenizer
    and processor (images, videos, 16 mel bins of audio)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    special = SPECIAL + OMNI_AUDIO
    tok = _tokenizer(special, EXTRA, "<|im_end|>", TEMPLATE, named=OMNI_NAMED)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = dict(vocab_size=288, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=4096, eos_token_id=eos[0],
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
                 output_dim=128, n_window=50, n_window_infer=400, downsample_hidden_size=8, max_source_positions=64)
    config = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], audio_token_id=ids["<|audio_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        audio_start_token_id=ids["<|audio_start|>"], audio_end_token_id=ids["<|audio_end|>"])
    _save(lambda: transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config), out, seed, tok, eos,
          ids["<|endoftext|>"], None)
    state = load_file(str(out / "model.safetensors"))
    save_file({f"thinker.{k}": v for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "enable_audio_output": False, "thinker_config": config.to_dict()}, indent=2))
    common = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                  size={"shortest_edge": 32 * 32, "longest_edge": PIXELS})
    transformers.Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(**common), video_processor=Qwen2VLVideoProcessor(**common),
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=16), tokenizer=tok,
        chat_template=TEMPLATE).save_pretrained(out)
    return out


# InternVL's image tokens after Qwen3-VL's, and what its processor reads as the tokenizer's attributes.
INTERNVL_IMAGE = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
INTERNVL_NAMED = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}


def _internvl(out: Path, seed: int) -> Path:
    """A tiny InternVL3.5 with a Qwen3-MoE text model as its -HF checkpoints are published (LLaVA's names, the
    experts per expert: transformers' own save), its tokenizer and processor (each 64x64 image one tile of 4x4
    patches, shuffled into 4 image tokens)."""
    import transformers
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor
    special = SPECIAL + INTERNVL_IMAGE
    template = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>")
    tok = _tokenizer(special, EXTRA, "<|im_end|>", template, named=INTERNVL_NAMED)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = dict(model_type="qwen3_moe", vocab_size=288, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                eos_token_id=eos[0])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[64, 64], patch_size=[16, 16])
    config = transformers.InternVLConfig(text_config=text, vision_config=vision, image_token_id=ids["<IMG_CONTEXT>"],
                                         downsample_ratio=0.5, tie_word_embeddings=False)
    _save(lambda: transformers.InternVLForConditionalGeneration(config), out, seed, tok, eos, ids["<|endoftext|>"],
          None)
    common = dict(size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    transformers.InternVLProcessor(image_processor=GotOcr2ImageProcessor(crop_to_patches=False, **common),
                                   video_processor=InternVLVideoProcessor(**common), tokenizer=tok,
                                   image_seq_length=4, chat_template=template).save_pretrained(out)
    return out


# Mistral's control tokens (Mistral Small 4's Tekken vocabulary, in part), and its turns (LLaMA-Factory's
# mistral_small template) as a chat template.
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                   "[IMG_BREAK]", "[IMG_END]", "<pad>"]
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}" + _content_of_message("[IMG]") +
    "{%- if message['role'] == 'user' %}{{- '[INST]' + content + '[/INST]' }}"
    "{%- else %}{{- content + eos_token }}{%- endif %}{%- endfor %}")


def _mistral3(out: Path, seed: int) -> Path:
    """A tiny Mistral Small 4 as transformers saves it (its BF16 conversions): a Mistral 4 text model inside Mistral
    3's image-text model (LLaVA's names, the experts fused), its tokenizer and Pixtral processor (each 64x64 image
    4x4 patches of 16 pixels, merged 2x2 into 4 image tokens, a row break after the first two)."""
    import transformers
    from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    tok = _tokenizer(MISTRAL_SPECIAL, [], "</s>", MISTRAL_TEMPLATE, pad="<pad>", bos="<s>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in MISTRAL_SPECIAL}
    text = dict(model_type="mistral4", vocab_size=288, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                routed_scaling_factor=1.5, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=ids["<s>"],
                eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, image_size=64, patch_size=16)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"],
                                         spatial_merge_size=2, multimodal_projector_bias=False,
                                         vision_feature_layer=-1, tie_word_embeddings=False)
    _save(lambda: transformers.Mistral3ForConditionalGeneration(config), out, seed, tok, [ids["</s>"]],
          ids["<pad>"], ids["<s>"])
    transformers.PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=16, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3),
        tokenizer=tok, patch_size=16, spatial_merge_size=2, chat_template=MISTRAL_TEMPLATE).save_pretrained(out)
    return out


def _tokenizer(special, extra, eos, template, pad="<|endoftext|>", bos=None, named=None):
    """A byte-level tokenizer with special (and extra) tokens after the bytes; named: the special tokens a processor
    reads as the tokenizer's attributes (Gemma 4's image_token, boi_token, ...)."""
    from transformers import Qwen2Tokenizer
    from tokenizers.pre_tokenizers import ByteLevel
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({t: 256 + i for i, t in enumerate(special + extra)})  # in the vocabulary: their ids stay put
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=bos, eos_token=eos, pad_token=pad,
                         split_special_tokens=False, **({"extra_special_tokens": named} if named else {}))
    tok.add_special_tokens({"extra_special_tokens": special}, replace_extra_special_tokens=False)
    tok.add_tokens(extra)
    tok.chat_template = template
    return tok


def write_image_text_moe(out: Path, model_type: str = "qwen3_vl_moe", seed: int = 0) -> Path:
    """A tiny qwen3_vl_moe, qwen3_5_moe (gated DeltaNet and gated attention layers, its experts fused as the module
    holds them) or glm4v_moe (shared experts, sigmoid routing; its experts per expert). Hidden 128, 2I = 64 and
    I = 32 all differ, so a transposed read of the experts cannot pass unnoticed."""
    import transformers
    if model_type == "llama4":
        return _llama4(out, seed)
    if model_type == "gemma4":
        return _gemma4(out, seed)
    if model_type == "qwen3_omni_moe":
        return _qwen3_omni(out, seed)
    if model_type == "internvl":
        return _internvl(out, seed)
    if model_type == "mistral3":
        return _mistral3(out, seed)
    glm = model_type == "glm4v_moe"
    tok = _tokenizer(GLM_SPECIAL, GLM_EXTRA, "<|endoftext|>", GLM_TEMPLATE) if glm else \
        _tokenizer(SPECIAL, EXTRA, "<|im_end|>", TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (GLM_SPECIAL if glm else SPECIAL)}
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]] if glm else \
        [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = dict(vocab_size=288, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=eos[0],
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=64)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"]) \
        if not glm else {}
    if model_type == "qwen3_vl_moe":
        config_class, model_class = transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration
        vision["deepstack_visual_indexes"] = [0, 1]
    elif model_type == "qwen3_5_moe":
        config_class, model_class = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
        text.update(shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)
        text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
    else:
        config_class, model_class = transformers.Glm4vMoeConfig, transformers.Glm4vMoeForConditionalGeneration
        text.update(n_routed_experts=text.pop("num_experts"), n_shared_experts=1, first_k_dense_replace=0,
                    n_group=1, topk_group=1, head_dim=32)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                   "mrope_section": [4, 2, 2]}
        vision.pop("num_position_embeddings")
        vision["image_size"] = 64
        tokens = dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                      image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                      video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])
    config = config_class(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # as in the demo: a wide enough lm_head for LoRA to fit the data
        model.lm_head.weight.normal_(0, 0.15)
    model.save_pretrained(out)
    if model_type == "qwen3_vl_moe":  # the experts as published: [E, H, 2I] and [E, I, H]
        state = load_file(str(out / "model.safetensors"))
        save_file({k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else v for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    transformers.GenerationConfig(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"],
                                  do_sample=False).save_pretrained(out)
    tok.save_pretrained(out)
    common = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                  size={"shortest_edge": 32 * 32, "longest_edge": PIXELS})
    if glm:
        from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
        from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
        transformers.Glm4vProcessor(image_processor=Glm4vImageProcessor(**common), tokenizer=tok,
                                    video_processor=Glm4vVideoProcessor(**common),
                                    chat_template=GLM_TEMPLATE).save_pretrained(out)
    else:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
        transformers.Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**common), tokenizer=tok,
                                      video_processor=Qwen3VLVideoProcessor(**common),
                                      chat_template=TEMPLATE).save_pretrained(out)
    return out


def write_image_data(out: Path) -> Path:
    """dataset `kt_colours`: one 64x64 image of each colour, asked what colour it is."""
    from PIL import Image
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, rgb in COLOURS.items():
        Image.new("RGB", (64, 64), rgb).save(out / f"{name}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                  {"role": "assistant", "content": f"It is {name}."}],
                     "images": [str(out / f"{name}.png")]})
    (out / "colours.json").write_text(json.dumps(rows))
    (out / "dataset_info.json").write_text(json.dumps({"kt_colours": {
        "file_name": "colours.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return out
