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


def grads(gc_kwargs, dropout=0.0):
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    torch.manual_seed(3)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False, lora_dropout=dropout))
    model.train()
    torch.manual_seed(4)  # the dropout masks (the experts draw their seed from torch's RNG)
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "lora_dropout"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_gives_same_gradients(use_reentrant, dropout):
    # With LoRA dropout the recomputed forward must drop what the first forward dropped: checkpointing restores
    # torch's RNG state, from which the experts draw their mask seed.
    plain = grads(None, dropout)
    ckpt = grads({"use_reentrant": use_reentrant}, dropout)
    assert any("experts.lora_A" in n for n in plain)
    for name, g in plain.items():
        assert rel_l2(ckpt[name], g) <= FP32_IO, name
