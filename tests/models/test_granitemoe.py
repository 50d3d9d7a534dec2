"""Granite MoE (granitemoe, granitemoeshared, granitemoehybrid): the stock block holds its experts as input_linear and
output_linear beside the router, which kt_sft holds as one experts module (models/granitemoe.py). Full fine-tuning
against stock transformers is in test_full_mode; here, state dicts in the stock names both ways, FP8/INT4 experts
from a BF16 checkpoint, what cannot be done named. test_peft_parity compares logits with the stock model, and LoRA
steps and generation with stock PEFT whose experts (ReferenceExperts) the block calls as kt_sft's does
(routed_forward, which the logits and test_full_mode's grads check against the stock block). Prepare and load are in
test_prepare_load, kt-sft merge in
test_merge, the shared MLP's overlap in test_shared_overlap, CUDA in test_gpu_hybrid, llamafactory-cli in
tests/integration/test_llamafactory_architectures.py."""
import copy

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kt_sft.cli import run
from kt_sft.integrations.export import export_adapter
from kt_sft.integrations.prepare import prepare
from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from test_gpt_oss import prepared_in_format
from test_peft_parity import batch, kt_and_reference
from tiny_models import save_checkpoint, tiny_model
from tolerances import BF16_GRAD, FP32_IO, MERGED_BF16, rel_l2

# Transformers 5.6's names of the experts' weights (later ones hold them as ours).
STOCK = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight"}


def stock_of(named: dict, name: str):
    """named[name] where the stock model holds name, else under transformers 5.6's name for it."""
    if name in named:
        return named[name]
    for ours, stock in STOCK.items():
        name = name.replace(ours, stock)
    return named[name]


def stock_experts(block) -> tuple:
    """A stock Granite MoE block's (gate_up, down) weights."""
    if hasattr(block, "experts"):
        return block.experts.gate_up_proj, block.experts.down_proj
    return block.input_linear.weight, block.output_linear.weight


def test_a_merged_save_loads_in_stock_transformers_with_the_adapters_logits(tmp_path):
    kt, _ = kt_and_reference("granitemoeshared")
    ids = batch(2)["input_ids"]
    with torch.no_grad():
        adapter = kt(ids).logits
    merged = kt.merge_and_unload()
    assert set(merged.state_dict()) == set(tiny_model("granitemoeshared").state_dict())
    merged.save_pretrained(tmp_path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(stock(ids).logits, adapter) <= MERGED_BF16


@pytest.mark.parametrize("strict", [True, False])
def test_a_stock_state_dict_loads_into_the_engine(strict):
    stock = tiny_model("granitemoehybrid", seed=5)
    kt = tiny_model("granitemoehybrid")
    use_cpu_experts(kt)
    result = kt.load_state_dict(stock.state_dict(), strict=strict)
    assert not result.missing_keys and not result.unexpected_keys
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("expert_format", ["fp8", "int4"])
def test_a_bf16_checkpoint_prepared_to_a_quantized_format(tmp_path, expert_format):
    # The fused experts read from input_linear / output_linear and quantized expert by expert at load.
    stock = tiny_model("granitemoe")
    kt = prepared_in_format(stock, tmp_path, expert_format)
    experts = {n: m for n, m in kt.named_modules() if isinstance(m, KTExpertsLinear)}
    for name, module in experts.items():  # the stock model on the weights the engine computes with (dequantized)
        block = stock.get_submodule(name.removesuffix(".experts"))
        with torch.no_grad():
            for stock_weight, weight in zip(stock_experts(block), module.base_weights()):
                stock_weight.copy_(weight.float())
    ids = batch(7)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


def test_per_expert_export_is_refused(tmp_path):
    # No runtime holds Granite's experts per expert: the adapter is served by kt_sft or merged (kt-sft merge).
    save_checkpoint(tiny_model("granitemoe"), tmp_path / "model")
    model = tiny_model("granitemoe")
    use_cpu_experts(model)
    model.requires_grad_(False)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["experts"])).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ValueError, match="granitemoe's experts exist only fused .* no runtime has the per-expert"):
        export_adapter(tmp_path / "adapter", tmp_path / "exported", tmp_path / "model")


def test_granites_own_expert_names_as_lora_targets_get_the_warning():
    # Stock PEFT refuses them (no linear layer); here they would reach no routed expert without a word.
    model = tiny_model("granitemoe")
    use_cpu_experts(model)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules=["q_proj", "input_linear", "output_linear"]))
    with pytest.warns(RuntimeWarning, match=r"LoRA targets \['input_linear', 'output_linear'\] name the routed experts'"):
        model(**batch(0))


def test_what_a_granite_checkpoint_lacks_or_adds_beside_its_experts_is_named(tmp_path):
    save_checkpoint(tiny_model("granitemoe"), tmp_path / "model")
    state = load_file(str(tmp_path / "model" / "model.safetensors"))
    extra = {**state, "model.layers.0.block_sparse_moe.input_linear.weight_g_idx": torch.zeros(6)}
    save_file(extra, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has model.layers.0.block_sparse_moe.input_linear.weight_g_idx beside layer "
                                         r"0's bf16 experts, which kt_sft does not read"):
        prepare(tmp_path / "model", tmp_path / "prepared")
    lacking = {k: v for k, v in state.items() if "layers.1.block_sparse_moe.input_linear" not in k
               and "layers.1.block_sparse_moe.output_linear" not in k}
    save_file(lacking, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has no model.layers.1.block_sparse_moe.input_linear.weight \(layer 1's "
                                         r"routed experts, which granitemoe checkpoints hold fused\)"):
        prepare(tmp_path / "model", tmp_path / "prepared")
