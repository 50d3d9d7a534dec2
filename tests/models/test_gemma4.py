"""Gemma 4 (26B-A4B) with its vision tower, on batches that hold images: the vision tower and attention in PyTorch, the
routed experts (GeGLU) on the engine, against the stock model and against stock transformers + PEFT with the same
LoRA (test_peft_parity's reference). Each image is 6 x 6 patches of 4 x 4 pixels, pooled 3 x 3 into 4 soft tokens
between its begin and end tokens."""
import copy

import pytest
import torch
import transformers

from kt_sft.models import use_cpu_experts
from test_peft_parity import kt_and_reference, train_alike
from tiny_models import GEMMA4_TEXT, GEMMA4_VISION, experts_rounded_to_bf16
from tolerances import FP32_IO, rel_l2

IMAGE, BEGIN, END = 93, 94, 95  # token ids within the tiny vocabulary
SIDE = 6  # patches per image side: pooled 3 x 3 (the vision config's pooling_kernel_size) into 4 soft tokens
SOFT = (SIDE // 3) ** 2


def gemma4_with_vision(seed: int = 0):
    config = transformers.Gemma4Config(text_config=GEMMA4_TEXT, vision_config=GEMMA4_VISION, image_token_id=IMAGE,
                                       boi_token_id=BEGIN, eoi_token_id=END)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return experts_rounded_to_bf16(model).eval()


def image_batch(seed: int, rows: int = 2) -> dict:
    """A training batch: each row an image inside random text; labels skip the image's tokens."""
    g = torch.Generator().manual_seed(seed)
    text = [torch.randint(0, IMAGE, (rows, n), generator=g) for n in (3, 4)]
    image = torch.tensor([BEGIN] + [IMAGE] * SOFT + [END]).expand(rows, -1)
    ids = torch.cat([text[0], image, text[1]], 1)
    grid = torch.stack(torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="xy"), -1).reshape(-1, 2)
    return dict(input_ids=ids, labels=ids.masked_fill(ids >= IMAGE, -100), mm_token_type_ids=(ids == IMAGE).long(),
                pixel_values=torch.rand(rows, SIDE * SIDE, 3 * 4 * 4, generator=g),
                image_position_ids=grid.expand(rows, -1, -1))


def without_labels(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def test_logits_with_images_match_the_stock_model():
    stock = gemma4_with_vision()
    kt = copy.deepcopy(stock)
    assert use_cpu_experts(kt) == 2
    batch = without_labels(image_batch(0))
    with torch.no_grad():
        got, want = kt(**batch).logits, stock(**batch).logits
        assert rel_l2(want, stock(input_ids=batch["input_ids"]).logits) > 0.01  # the image changes the logits
    assert rel_l2(got, want) <= FP32_IO


# LoRA on the text model's attention outputs (the vision tower's are not nn.Linear) and the routed experts.
OUTPUTS = [f"language_model.layers.{n}.self_attn.o_proj" for n in (0, 1)]


def test_lora_training_steps_with_images_match_the_reference():
    train_alike(*kt_and_reference("gemma4", gemma4_with_vision(), OUTPUTS), image_batch)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_about_an_image_with_the_adapter_matches_the_reference(use_cache):
    kt, ref = kt_and_reference("gemma4", gemma4_with_vision(), OUTPUTS)
    batch = without_labels(image_batch(3, rows=1))
    out = [m.eval().generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=use_cache,
                             output_logits=True, return_dict_in_generate=True) for m in (kt, ref)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel_l2(torch.stack(out[0].logits), torch.stack(out[1].logits)) <= FP32_IO
