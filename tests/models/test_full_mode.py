"""Full-parameter mode: every weight trains; expert weight grads come from the engine (accumulated into
BF16 param.grad), everything else from autograd. Compared with the stock model in float32."""
import copy

import torch

from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import tiny_model
from tolerances import BF16_GRAD, FP32_IO, rel_l2


def test_full_mode_gradients_match_stock_model():
    stock = tiny_model("qwen3_moe").train()
    kt = copy.deepcopy(stock)
    use_cpu_experts(kt)
    kt.requires_grad_(True)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (stock, kt):
        for micro in range(2):  # two micro-batches: base grads accumulate
            model(input_ids=ids.roll(micro, 1), labels=ids.roll(micro, 1)).loss.backward()
    stock_grads = dict(stock.named_parameters())
    experts = {n for n, m in kt.named_modules() if isinstance(m, KTExpertsLinear)}
    checked = 0
    for name, p in kt.named_parameters():
        ref = stock_grads[name].grad
        if name.rpartition(".")[0] in experts:
            assert p.grad.dtype == torch.bfloat16
            assert rel_l2(p.grad, ref) <= BF16_GRAD, name
            checked += 1
        else:
            assert rel_l2(p.grad, ref) <= FP32_IO, name
    assert checked == 4  # gate_up_proj and down_proj of both MoE layers
