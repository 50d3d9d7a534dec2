"""Llama 4: its MoE block scales each token by its routing weight before the experts, which the stock block runs on
every token (the unrouted ones on zeros); kt_sft's block gives the engine the scaled tokens of each routed expert.
Tiny image-text models against stock transformers, with images, at top-1 (as published) and top-2; their saves in
the stock (transposed) layout."""
import copy
import warnings

import peft
import pytest
import torch
import transformers

from kt_sft.models import use_cpu_experts
from kt_sft.models.overlap import installed_overlaps
from kt_sft.peft.layer import KTExpertsLinear
from test_gradient_checkpointing import engine_forwards
from test_peft_parity import kt_and_reference, train_alike
from tiny_models import CONFIGS, tiny_model
from tolerances import FP32_IO, MERGED_BF16, rel_l2


def batch(seed: int) -> dict:
    """Two rows of text, each with one 16x16 image (4 image tokens), and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 14), generator=g)
    ids[:, 3:7] = 96
    return dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g), labels=ids)


def model_at_top_k(top_k: int, every: int = 1):
    """The tiny Llama 4 routing each token to top_k experts, with MoE layers every `every` layers (Maverick's 2: four
    layers, dense MLPs between its MoE blocks)."""
    torch.manual_seed(0)
    if top_k == 1 and every == 1:
        return tiny_model("llama4")
    config = CONFIGS["llama4"]()
    text = {**config.text_config.to_dict(), "num_experts_per_tok": top_k, "interleave_moe_layer_step": every,
            "num_hidden_layers": 2 * every, "moe_layers": None, "layer_types": None, "no_rope_layers": None}
    config = transformers.Llama4Config(text_config=text, vision_config=config.vision_config.to_dict(),
                                       image_token_index=96, boi_token_index=97, eoi_token_index=98)
    return transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("top_k, every", [(1, 1), (2, 1), (1, 2)], ids=["top_1", "top_2", "moe_every_2"])
def test_logits_with_images_match_stock(top_k, every):
    stock = model_at_top_k(top_k, every)
    with torch.no_grad():  # the engine's BF16 weights
        for block in (m for m in stock.modules() if type(m).__name__ == "Llama4TextExperts"):
            for p in (block.gate_up_proj, block.down_proj):
                p.copy_(p.bfloat16().float())
    kt = copy.deepcopy(stock)
    assert use_cpu_experts(kt) == 2
    inputs = {k: v for k, v in batch(0).items() if k != "labels"}
    with torch.no_grad():
        assert rel_l2(kt(**inputs).logits, stock(**inputs).logits) <= FP32_IO


def test_lora_training_steps_with_images_match_reference():
    train_alike(*kt_and_reference("llama4"), batch)


def test_the_shared_expert_runs_beside_the_engine():
    kt, _ = kt_and_reference("llama4")
    assert len(installed_overlaps(kt)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overlap turns itself off with a warning
        kt(**batch(1)).loss.backward()
    assert len(installed_overlaps(kt)) == 2


def test_a_merged_save_loads_in_stock_transformers_with_the_adapters_logits(tmp_path):
    kt, _ = kt_and_reference("llama4")
    inputs = {k: v for k, v in batch(2).items() if k != "labels"}
    with torch.no_grad():
        adapter = kt(**inputs).logits
    merged = kt.merge_and_unload()
    assert all(isinstance(m, KTExpertsLinear) for m in merged.modules() if type(m).__name__.endswith("Experts"))
    state = merged.state_dict()
    assert state["language_model.model.layers.0.feed_forward.experts.gate_up_proj"].shape == (6, 64, 80)
    merged.save_pretrained(tmp_path)
    stock = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(stock(**inputs).logits, adapter) <= MERGED_BF16


def checkpointed_grads(top_k: int, gc_kwargs):
    model = model_at_top_k(top_k)
    use_cpu_experts(model)
    torch.manual_seed(3)
    model = peft.get_peft_model(model.requires_grad_(False), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)).train()
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    model(**batch(4)).loss.backward()
    # The language model's: under reentrant checkpointing the vision tower's LoRA gets no grads, in stock too.
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and "language_model." in n}


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
def test_checkpointing_runs_each_blocks_engine_forward_once_with_the_same_grads(top_k, use_reentrant, monkeypatch):
    # A block's top_k scaled copies of its tokens go to the engine in one call, whose first pass the recompute finds
    # kept (one call per copy had missed it at every step, and turned keeping off after three).
    plain = checkpointed_grads(top_k, None)
    calls = engine_forwards(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # kt_sft's: a recompute that missed the kept pass
        ckpt = checkpointed_grads(top_k, {"use_reentrant": use_reentrant})
    assert len(calls) == 2  # the two MoE layers' forwards, not recomputed
    assert plain.keys() == ckpt.keys() and any("experts.lora_A" in n for n in plain)
    for name, g in plain.items():
        assert rel_l2(ckpt[name], g) <= FP32_IO, name
