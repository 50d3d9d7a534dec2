"""Qwen3-VL-MoE served whole: images through the vision tower, text and routed experts through the CPU engine,
against the stock model (checkpoints as published, fused experts transposed) and against stock transformers + PEFT
with the same LoRA (test_peft_parity's reference) on batches that hold images."""
import pytest
import torch
import transformers
from safetensors import safe_open

from kt_sft.cli import run
from kt_sft.peft.layer import KTExpertsLinear
from test_peft_parity import kt_and_reference, lora_tensors
from tiny_models import image_batch, qwen3_vl_moe_published, save_checkpoint, tiny_model
from tolerances import FP32_IO, TRAIN_STEPS, rel_l2

INPUTS = ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")


def inputs(batch):
    return {k: batch[k] for k in INPUTS}


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


def test_fused_experts_of_another_shape_are_refused_naming_both_layouts(tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "src"
    qwen3_vl_moe_published(src)
    state = load_file(str(src / "model.safetensors"))
    key = "model.language_model.layers.1.mlp.experts.down_proj"
    state[key] = state[key][:, :, :32].contiguous()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj have shapes \[8, 64, 80\] and \[8, 40, 32\] but config.json "
                                         r"implies \[8, 80, 64\] and \[8, 64, 40\] or \[8, 64, 80\] and \[8, 40, 64\]"):
        run(["prepare", str(src), str(tmp_path / "prepared")])


def test_lora_training_steps_with_images_match_reference():
    kt, ref = kt_and_reference("qwen3_vl_moe")
    names = lora_tensors(kt)
    assert set(names) == set(lora_tensors(ref)) and any("experts.lora_A" in n for n in names)
    opts = [torch.optim.AdamW(lora_tensors(m).values(), lr=1e-3) for m in (kt, ref)]
    for step in range(5):
        losses = []
        for model, opt in zip((kt, ref), opts):
            opt.zero_grad()
            loss = model(**image_batch(step)).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= TRAIN_STEPS * abs(losses[1]), f"step {step}: {losses}"
    ref_t = lora_tensors(ref)
    for name, t in lora_tensors(kt).items():
        assert rel_l2(t, ref_t[name]) <= TRAIN_STEPS, name


def test_generation_about_an_image_with_the_adapter_matches_the_reference():
    kt, ref = kt_and_reference("qwen3_vl_moe")
    batch = inputs(image_batch(3, rows=1))
    out = [m.eval().generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True) for m in (kt, ref)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel_l2(torch.stack(out[0].logits), torch.stack(out[1].logits)) <= FP32_IO
