"""LLaMA-Factory's optimizers that read each parameter as one matrix (Adam-mini, Muon), met with the routed experts'
LoRA, stacked per expert: built as LLaMA-Factory builds them, then stepped once."""
import warnings

import pytest
import torch
from llamafactory.train.trainer_utils import _create_adam_mini_optimizer, _create_muon_optimizer
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

from kt_sft.models import use_cpu_experts
from tiny_models import tiny_model


def lora_model(targets):
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    model = get_peft_model(model.requires_grad_(False), LoraConfig(r=4, lora_alpha=8, target_modules=targets)).train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, use_cpu=True, report_to=[])


def test_adam_mini_is_refused_in_one_sentence_with_the_experts_lora(tmp_path):
    # It had failed at its first step with a reshape error inside adam_mini.
    optimizer = _create_adam_mini_optimizer(lora_model(["o_proj", "experts"]), args(tmp_path))
    for _ in range(2):  # a retry too (it had reached adam_mini's reshape error)
        with pytest.raises(ValueError, match=r"Adam-mini .* cannot take the routed experts' LoRA.*leave `experts`"):
            optimizer.step()
    _create_adam_mini_optimizer(lora_model(["o_proj"]), args(tmp_path)).step()  # without the experts: as before


def test_muon_says_the_experts_lora_trains_with_its_adamw_part(tmp_path):
    # The experts' LoRA had gone to Muon's AdamW part without a word.
    model = lora_model(["o_proj", "experts"])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with pytest.warns(RuntimeWarning, match=r"Muon .* the routed experts' LoRA, .* trains with Muon's AdamW part"):
        _create_muon_optimizer(model, args(tmp_path)).step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_B" in n)
    without = _create_muon_optimizer(lora_model(["o_proj"]), args(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        without.step()
