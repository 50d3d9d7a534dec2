"""Gradient checkpointing (LLaMA-Factory's default) gives the same gradients as without it.

Policy (README "Gradient checkpointing"): a checkpointed layer reruns its forward in backward, the routed
experts included. Reentrant checkpointing runs the first forward without grad, so the engine saves nothing
then; non-reentrant keeps the engine's saved g/u from the first forward until backward.
"""
import pytest
import torch
from peft import LoraConfig, get_peft_model

from kt_sft.models import use_cpu_experts
from tiny_models import tiny_model
from tolerances import FP32_IO, rel_l2


def grads(gc_kwargs):
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    torch.manual_seed(3)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False))
    model.train()
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_gives_same_gradients(use_reentrant):
    plain = grads(None)
    ckpt = grads({"use_reentrant": use_reentrant})
    assert any("experts.lora_A" in n for n in plain)
    for name, g in plain.items():
        assert rel_l2(ckpt[name], g) <= FP32_IO, name
