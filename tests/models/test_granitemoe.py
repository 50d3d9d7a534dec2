"""Granite MoE (granitemoe, granitemoeshared, granitemoehybrid): transformers 5.6's block holds its experts as
input_linear and output_linear beside the router, which kt_sft holds as one experts module (models/granitemoe.py).
Here: a stock state dict loads into the engine, FP8/INT4 experts from a BF16 checkpoint, Granite's own expert names as
LoRA targets, and what cannot be done named. Elsewhere: full fine-tuning against stock transformers (test_full_mode);
logits against the stock model, and LoRA steps and generation against stock PEFT whose experts (ReferenceExperts) the
block calls as kt_sft's does (test_peft_parity); merged saves and kt-sft merge (test_merge); prepare and load
(test_prepare_load); the shared MLP's overlap (test_shared_overlap); CUDA (test_gpu_hybrid); llamafactory-cli
(tests/integration/test_llamafactory_architectures.py)."""
import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from kt_sft.integrations.export import export_adapter
from kt_sft.integrations.prepare import prepare
from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from test_gpt_oss import prepared_in_format
from test_peft_parity import batch
from tiny_models import save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2

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
    with pytest.warns(RuntimeWarning,
                      match=r"LoRA targets \['input_linear', 'output_linear'\] name the routed experts'"):
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
