"""Nemotron-H (nemotron_h): routed experts without a gate (up, relu², down), published per expert under backbone.
Its parity with stock transformers + PEFT is in test_peft_parity, with the prepare, merge, export, full-mode, overlap,
CUDA and llamafactory-cli tests beside; here what is its own: a BF16 checkpoint quantized at prepare, experts in the
latent width that moe_latent_size gives (exported too), the stock fused name in state dicts, and LoRA on the gate these
experts do not have."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

import kt_sft
from kt_sft.cli import run
from kt_sft.formats import QuantizedExperts
from kt_sft.loader.model import model_class
from kt_sft.models import use_cpu_experts
from kt_sft.ops.reference import RELU2
from kt_sft.peft.layer import KTExpertsLinear
from test_gpt_oss import prepared_in_format, stock_with_the_experts_of
from test_peft_parity import batch
from tiny_models import CONFIGS, experts_rounded_to_bf16, save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2


@pytest.mark.parametrize("expert_format", ["fp8", "int4"])
def test_a_bf16_checkpoint_prepared_to_a_quantized_format(tmp_path, expert_format):
    # Up's and down's rows quantized expert by expert at load, no gate among them.
    stock = tiny_model("nemotron_h")
    kt = prepared_in_format(stock, tmp_path, expert_format)
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    assert all(m.unit == RELU2 and m.gate_up_proj.shape[1] == m.intermediate_size for m in experts)
    ids = batch(7)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock_with_the_experts_of(stock, kt)(ids).logits) <= FP32_IO


def test_experts_in_the_latent_width_match_stock():
    # moe_latent_size: the block projects its input into that width for the experts and back (on the GPU); the
    # engine's experts are that wide.
    config = CONFIGS["nemotron_h"]()
    config.moe_latent_size = 32
    torch.manual_seed(0)
    stock = experts_rounded_to_bf16(model_class(config).from_config(config, dtype=torch.float32)).eval()
    kt = copy.deepcopy(stock)
    use_cpu_experts(kt)
    assert [m.hidden_size for m in kt.modules() if isinstance(m, KTExpertsLinear)] == [32, 32]
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


def test_lora_on_a_gate_the_experts_do_not_have_is_refused():
    model = tiny_model("nemotron_h")
    use_cpu_experts(model)
    experts = next(m for m in model.modules() if isinstance(m, KTExpertsLinear))
    with pytest.raises(ValueError, match=r"unknown expert projections \['gate'\] \(these experts have no gate"):
        experts.add_lora(4, 8.0, projections=("gate", "up"))
    experts.add_lora(4, 8.0)  # every projection they have
    assert sorted(experts.lora_A["default"]) == ["down", "up"]


def test_quantized_experts_must_agree_with_the_unit_about_the_gate():
    gate_up, down = torch.randn(2, 16, 32), torch.randn(2, 32, 8)  # 16 rows: gate's and up's 8, or up's 16
    with pytest.raises(ValueError, match="built with a gate, but the unit has none; quantize them with gated=False"):
        kt_sft.KTExperts(QuantizedExperts.quantize("int4", gate_up, down), unit=RELU2)
    with pytest.raises(ValueError, match=r"up_proj \(2, 16, 32\) and down_proj \(2, 32, 8\) do not describe the same "
                                         r"experts; they must be \[E, I, H\] and \[E, H, I\]"):
        kt_sft.KTExperts(gate_up.bfloat16(), down.bfloat16(), unit=RELU2)


def test_its_state_dict_with_the_stock_fused_names_loads_back():
    # The state dict names the experts' stack experts.up_proj, as the stock model does; both load into the engine.
    stock = tiny_model("nemotron_h")
    kt = tiny_model("nemotron_h", seed=3)
    use_cpu_experts(kt)
    assert "model.layers.1.mixer.experts.up_proj" in kt.state_dict()
    kt.load_state_dict(stock.state_dict())
    kt.load_state_dict(kt.state_dict())
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


def test_an_adapter_on_experts_in_the_latent_width_exports_under_the_checkpoints_names(tmp_path):
    # The experts' LoRA per expert, and the attention's, under the checkpoint's names (backbone.).
    config = CONFIGS["nemotron_h"]()
    config.moe_latent_size = 32
    torch.manual_seed(0)
    model = experts_rounded_to_bf16(model_class(config).from_config(config, dtype=torch.float32))
    save_checkpoint(model, tmp_path / "model")
    use_cpu_experts(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    get_peft_model(model.requires_grad_(False), lora).save_pretrained(tmp_path / "adapter")
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(tmp_path / "model")]) == 0
    keys = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert "base_model.model.backbone.layers.1.mixer.experts.0.up_proj.lora_A.weight" in keys
    assert "base_model.model.backbone.layers.2.mixer.o_proj.lora_A.weight" in keys
    assert not [k for k in keys if k.startswith("base_model.model.model.")]
