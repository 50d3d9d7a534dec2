"""Image-text MoE models served whole (Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V): images through the vision tower, text
and routed experts through the CPU engine, against the stock model (checkpoints as published: Qwen3-VL-MoE's fused
experts transposed, Qwen3.5-MoE's as the module holds them, GLM-4.5V's per expert) and against stock transformers +
PEFT with the same LoRA (test_peft_parity's reference) on batches that hold images."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kt_sft.cli import run
from kt_sft.formats import fp8_block
from kt_sft.loader import model as loader_model
from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import FP8_CONFIG
from test_peft_parity import kt_and_reference, train_alike
from tiny_models import (image_batch, image_batch_of, internvl_batch, qwen3_5_moe_published, qwen3_vl_moe_published,
                         save_checkpoint, tiny_model)
from tolerances import FP32_IO, rel_l2

INPUTS = ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw", "image_sizes")


def inputs(batch):
    return {k: batch[k] for k in INPUTS if k in batch}


@pytest.mark.parametrize("layout", ["published", "module"])
def test_prepared_model_reads_either_fused_layout_and_matches_with_images(tmp_path, layout):
    src = tmp_path / "src"
    if layout == "published":
        stock = qwen3_vl_moe_published(src)
    else:  # as transformers 5.6 saves a model built from its config
        stock = tiny_model("qwen3_vl_moe")
        save_checkpoint(stock, src)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        shape = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == ([8, 64, 80] if layout == "published" else [8, 80, 64])
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 2
    batch = image_batch(0)
    with torch.no_grad():
        logits, want = model(**inputs(batch)).logits, stock(**inputs(batch)).logits
        text_only = stock(input_ids=batch["input_ids"]).logits
    assert rel_l2(logits, want) <= FP32_IO
    assert rel_l2(text_only, want) > 0.1  # the images reach the logits


def test_qwen3_5_moe_as_published_serves_the_whole_model_reading_its_experts_once(tmp_path, monkeypatch):
    # The text model's weights under model.language_model., its experts fused, lm_head, the vision tower and the
    # multi-token-prediction module beside them (mtp.*, skipped).
    stock = qwen3_5_moe_published(tmp_path / "published")
    assert run(["prepare", str(tmp_path / "published"), str(tmp_path / "out")]) == 0
    read = []
    real = loader_model.read_weight
    monkeypatch.setattr(loader_model, "read_weight",
                        lambda ckpt, key, *a, **kw: read.append(key) or real(ckpt, key, *a, **kw))
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    # transformers maps a causal LM to Qwen3.5-MoE's config: through AutoModelForCausalLM (the way without
    # LLaMA-Factory) the prepared directory gives the same whole model, not transformers' class on no weights.
    causal = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                               dtype=torch.float32)
    assert type(causal).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 2
    assert read and not [k for k in read if ".experts." in k]  # the experts are read into the engine only, once
    assert not [k for k in read if k.startswith("mtp.")]
    batch = inputs(image_batch(0))
    with torch.no_grad():
        assert rel_l2(model(**batch).logits, stock(**batch).logits) <= FP32_IO


def test_glm4v_moe_as_published_loads_and_matches_with_images_skipping_its_prediction_layer(tmp_path):
    # GLM-4.5V publishes its experts per expert under model.language_model., and its multi-token-prediction layer
    # as model.language_model.layers.46, which transformers' class skips (the tiny model has 2 layers: prepare had
    # refused it as a layer past num_hidden_layers).
    stock = tiny_model("glm4v_moe")
    save_checkpoint(stock, tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert "model.language_model.layers.1.mlp.experts.0.gate_proj.weight" in state
    extra = {f"model.language_model.layers.46.{k.split('.layers.1.', 1)[1]}": v.clone()
             for k, v in state.items() if ".layers.1." in k}
    save_file({**state, **extra}, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 1  # layer 0 is dense
    batch = inputs(image_batch(0))
    with torch.no_grad():
        assert rel_l2(model(**batch).logits, stock(**batch).logits) <= FP32_IO


def test_fused_experts_of_another_shape_are_refused_naming_both_layouts(tmp_path):
    src = tmp_path / "src"
    qwen3_vl_moe_published(src)
    state = load_file(str(src / "model.safetensors"))
    key = "model.language_model.layers.1.mlp.experts.down_proj"
    state[key] = state[key][:, :, :32].contiguous()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj have shapes \[8, 64, 80\] and \[8, 40, 32\] but config.json "
                                         r"implies \[8, 80, 64\] and \[8, 64, 40\] or \[8, 64, 80\] and \[8, 40, 64\]"):
        run(["prepare", str(src), str(tmp_path / "prepared")])


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe", "internvl", "mistral3"])
def test_lora_training_steps_with_images_match_reference(model_type):
    train_alike(*kt_and_reference(model_type), image_batch_of(model_type))


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe", "internvl", "mistral3"])
def test_generation_about_an_image_with_the_adapter_matches_the_reference(model_type):
    kt, ref = kt_and_reference(model_type)
    batch = inputs(image_batch_of(model_type)(3, rows=1))
    out = [m.eval().generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True) for m in (kt, ref)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel_l2(torch.stack(out[0].logits), torch.stack(out[1].logits)) <= FP32_IO


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_fp8_checkpoint_with_experts_per_expert_loads_and_matches_with_images(tmp_path, model_type):
    # Qwen3-VL-MoE's and Qwen3.5-MoE's FP8 releases keep each expert's projections apart (weight + weight_scale_inv
    # per 128x128 block), where their BF16 ones fuse them; the text model's other projections in FP8 too, the vision
    # tower unquantized. The stock model takes the values the FP8 codes decode to.
    stock = tiny_model(model_type)
    state, out, I = {k: v.clone() for k, v in stock.state_dict().items()}, {}, 40

    def fp8(key, w):
        q, scale = fp8_block.quantize(w)
        out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
        w.copy_(fp8_block.dequantize(q, scale))

    for key, t in state.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = key.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                for proj, w in ({"gate_proj": t[e, :I], "up_proj": t[e, I:]} if key.endswith("gate_up_proj")
                                else {"down_proj": t[e]}).items():
                    fp8(f"{base}.{e}.{proj}.weight", w)
        elif key.startswith("model.language_model.layers.") and key.endswith("proj.weight"):
            fp8(key, t)
        else:
            out[key] = t
    stock.load_state_dict(state)
    src = tmp_path / "fp8"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in out.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({**stock.config.to_dict(), "quantization_config": FP8_CONFIG}))
    (src / "tokenizer_config.json").write_text("{}")
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert all(m.expert_format == "fp8" for m in model.modules() if isinstance(m, KTExpertsLinear))
    batch = inputs(image_batch(1))
    with torch.no_grad():
        assert rel_l2(model(**batch).logits, stock(**batch).logits) <= FP32_IO


def test_llamafactorys_targets_by_path_pass_over_the_shared_experts_block_but_not_a_block_left_half_out():
    # LLaMA-Factory names an image-text model's LoRA targets by path (patch_target_modules): every module whose path
    # contains a target name, so `experts` named GLM-4.5V's shared_experts MLP and its activation too, which PEFT
    # refused.
    import peft
    model = tiny_model("glm4v_moe")
    use_cpu_experts(model)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"]
    forbidden = ["visual.patch_embed", "visual.blocks", "visual.merger"]  # LLaMA-Factory 0.9.5's for glm4v_moe
    paths = [n for n, _ in model.named_modules() if any(t in n for t in names) and not any(f in n for f in forbidden)]
    assert "model.language_model.layers.1.mlp.shared_experts" in paths
    if tuple(map(int, peft.__version__.split(".")[:2])) >= (0, 19):
        # peft 0.19 on writes the shared experts' gate_proj/up_proj/down_proj of an MoE model as target_parameters on
        # the fused experts, which kt_sft refuses naming peft 0.18.1, LLaMA-Factory 0.9.5's pin (test_peft_parity).
        with pytest.raises(ValueError, match="target_parameters .* name the routed experts' fused weights"):
            peft.get_peft_model(model.requires_grad_(False), peft.LoraConfig(r=4, target_modules=paths))
        return
    lora = peft.get_peft_model(model.requires_grad_(False), peft.LoraConfig(r=4, target_modules=paths))
    lora.add_adapter("second", peft.LoraConfig(r=2, target_modules=paths))  # its linear layers wrapped by the first
    trained = {n for n, p in lora.named_parameters() if "lora_A" in n}
    for adapter in ("default", "second"):
        assert any(f"shared_experts.gate_proj.lora_A.{adapter}" in n for n in trained)
        assert any(f".mlp.experts.lora_A.{adapter}" in n for n in trained)
    other = tiny_model("glm4v_moe")
    use_cpu_experts(other)
    with pytest.raises(ValueError, match="is not supported"):  # its linear layers not among the targets
        peft.get_peft_model(other.requires_grad_(False), peft.LoraConfig(r=4, target_modules=["shared_experts"]))
    stock = tiny_model("qwen3_moe")  # no CPU experts: PEFT's own refusal of its experts module, as without kt_sft
    with pytest.raises(ValueError, match="is not supported"):
        peft.get_peft_model(stock.requires_grad_(False), peft.LoraConfig(r=4, target_modules=["q_proj", "experts"]))


def test_internvl_as_published_loads_and_matches_with_images(tmp_path):
    # InternVL3.5's -HF checkpoints keep LLaVA's names (language_model.model., language_model.lm_head, vision_tower,
    # multi_modal_projector), as transformers saves them, the experts per expert.
    stock = tiny_model("internvl")
    save_checkpoint(stock, tmp_path / "src")
    with safe_open(str(tmp_path / "src" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"language_model.model.layers.0.mlp.experts.7.down_proj.weight", "language_model.lm_head.weight",
            "multi_modal_projector.linear_1.weight"} <= keys
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "prepared")]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                                     dtype=torch.float32)
    assert type(model).__name__ == "InternVLForConditionalGeneration"
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 2
    batch = inputs(internvl_batch(0))
    with torch.no_grad():
        logits = model(**batch).logits
        assert rel_l2(logits, stock(**batch).logits) <= FP32_IO
        assert rel_l2(model(input_ids=batch["input_ids"]).logits, logits) > 0.1  # the images reach the logits


def test_internvl_with_a_text_model_of_another_kind_is_refused(tmp_path):
    config = transformers.InternVLConfig(**{**tiny_model("internvl").config.to_dict(), "text_config": {
        "model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}})
    save_checkpoint(transformers.InternVLForConditionalGeneration(config), tmp_path / "src")
    with pytest.raises(ValueError, match="this internvl model's text model is qwen2; kt_sft serves internvl with a "
                                         "qwen3_moe text model only"):
        run(["prepare", str(tmp_path / "src"), str(tmp_path / "prepared")])
