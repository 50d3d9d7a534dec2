"""GPT-OSS: experts with gate/up and down biases and a clamped gated unit, held transposed with gate's and up's
outputs interleaved. Full fine-tuning (the biases' grads too) against stock transformers; saves in the stock layout
that stock transformers loads; adapter saves that leave the expert weights as they are."""
import copy
import json

import peft
import pytest
import torch
import transformers

from safetensors.torch import save_file

from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kt_sft.formats import QuantizedExperts, mxfp4
from kt_sft.cli import run
from kt_sft.integrations.export import export_adapter
from kt_sft.integrations.merge import merge_adapter
from kt_sft.integrations.prepare import prepare
from kt_sft.models import architecture_of, use_cpu_experts
from kt_sft.nn import stock_layout
from kt_sft.peft.layer import KTExpertsLinear
from test_gradient_checkpointing import engine_forwards, grads
from test_peft_parity import batch, kt_and_reference
from tiny_models import CONFIGS, save_checkpoint, tiny_model
from tolerances import BF16_GRAD, FP32_IO, rel_l2

EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def test_full_mode_gradients_match_stock_model():
    stock = tiny_model("gpt_oss").train()
    kt = copy.deepcopy(stock)
    use_cpu_experts(kt)
    kt.requires_grad_(True)
    ids = batch(0)["input_ids"]
    for model in (stock, kt):
        for micro in range(2):  # two micro-batches: the grads accumulate
            model(input_ids=ids.roll(micro, 1), labels=ids.roll(micro, 1)).loss.backward()
    layout = architecture_of(stock.config).stock_layout()
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    checked = 0
    for name, p in kt.named_parameters():
        module, _, param = name.rpartition(".")
        ref = stock_grads[name]
        if param in EXPERT_PARAMS and isinstance(kt.get_submodule(module), KTExpertsLinear):
            if param == "gate_up_proj_bias":
                ref = layout.engine_bias(ref)
            elif param != "down_proj_bias":
                ref = layout.engine_weights(ref, ref)[0 if param == "gate_up_proj" else 1]
            # The weights' grads land in their BF16 param.grad; the biases' are float32, as the tiny model's biases.
            assert rel_l2(p.grad, ref) <= (BF16_GRAD if p.dtype == torch.bfloat16 else FP32_IO), name
            checked += 1
        else:
            assert rel_l2(p.grad, ref) <= FP32_IO, name
    assert checked == 8  # the four expert tensors of both MoE layers


def test_a_stock_state_dict_loads_into_the_engine():
    stock = tiny_model("gpt_oss", seed=5)
    kt = tiny_model("gpt_oss")
    use_cpu_experts(kt)
    assert not kt.load_state_dict(stock.state_dict(), strict=True).missing_keys
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


def test_an_adapter_save_copies_no_expert_weights(tmp_path, monkeypatch):
    # PEFT reads the whole model's state_dict() for an adapter: the stock layout's gate/up interleaving would copy
    # every layer's gate_up_proj (as much host RAM again as the BF16 experts) at each checkpoint.
    kt, _ = kt_and_reference("gpt_oss")
    interleave = stock_layout._interleave
    copied = []
    monkeypatch.setattr(stock_layout, "_interleave", lambda t: copied.append(t.shape) or interleave(t))
    kt.save_pretrained(tmp_path)
    assert copied == [(6, 80)] * 2  # the gate/up biases only, which an adapter with bias="all" saves
    state = peft.get_peft_model_state_dict(kt)
    assert state and all("lora_" in k for k in state)
    fresh = tiny_model("gpt_oss")
    use_cpu_experts(fresh)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    ids = batch(4)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, kt(ids).logits)


@pytest.mark.parametrize("expert_format", ["fp8", "int4"])
def test_quantized_experts_keep_their_biases_and_unit(expert_format):
    stock = tiny_model("gpt_oss")
    kt = copy.deepcopy(stock)
    use_cpu_experts(kt)
    for name, module in list(kt.named_modules()):
        if isinstance(module, KTExpertsLinear):
            q = QuantizedExperts.quantize(expert_format, module.gate_up_proj.detach(), module.down_proj.detach())
            new = KTExpertsLinear(q, gate_up_proj_bias=module.gate_up_proj_bias.detach(),
                                  down_proj_bias=module.down_proj_bias.detach(), unit=module.unit,
                                  stock_layout=module.stock_layout)
            parent, _, child = name.rpartition(".")
            setattr(kt.get_submodule(parent), child, new)
    ids = batch(5)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock_with_the_experts_of(stock, kt)(ids).logits) <= FP32_IO


def stock_with_the_experts_of(stock, kt):
    """stock with each MoE layer's experts set to what kt's engine computes with (dequantized FP8/INT4)."""
    for name, module in kt.named_modules():
        if isinstance(module, KTExpertsLinear):
            gate_up, down = module.base_weights()
            target = stock.get_submodule(name)
            with torch.no_grad():
                getattr(target, module.stock_layout.fused_name).copy_(
                    module.stock_layout._to_stock("gate_up_proj", gate_up.float()))
                target.down_proj.copy_(module.stock_layout._to_stock("down_proj", down.float()))
    return stock


def prepared_in_format(stock, tmp_path, expert_format: str):
    """stock saved as a BF16 checkpoint, prepared with --expert-format expert_format and loaded (float32 outside the
    experts), its two MoE layers' experts in that format."""
    save_checkpoint(stock, tmp_path / "model")
    assert run(["prepare", str(tmp_path / "model"), str(tmp_path / "prepared"), "--expert-format",
                expert_format]) == 0
    kt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                           dtype=torch.float32)
    assert [m.expert_format for m in kt.modules() if isinstance(m, KTExpertsLinear)] == [expert_format] * 2
    return kt


@pytest.mark.parametrize("expert_format", ["fp8", "int4"])
def test_a_bf16_checkpoint_prepared_to_a_quantized_format(tmp_path, expert_format):
    # The fused, transposed and interleaved experts quantized expert by expert at load, their biases beside them.
    stock = tiny_model("gpt_oss")
    kt = prepared_in_format(stock, tmp_path, expert_format)
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    assert all(m.gate_up_proj_bias is not None and m.unit == architecture_of(stock.config).unit for m in experts)
    ids = batch(7)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock_with_the_experts_of(stock, kt)(ids).logits) <= FP32_IO


def test_lora_sft_with_the_transformers_trainer_on_a_prepared_checkpoint(tmp_path):
    # LLaMA-Factory 0.9.5 cannot train GPT-OSS (its configure_attn_implementation imports a transformers function
    # that 5.6 lacks, for a hub kernel, before any model loads), so this is its way: the Trainer and PEFT on the
    # prepared directory; the adapter it saves serves the trained model.
    stock = tiny_model("gpt_oss")
    with torch.no_grad():  # as in the demo: a wide enough lm_head for LoRA to fit the data
        stock.lm_head.weight.normal_(0, 0.15)
    save_checkpoint(stock, tmp_path / "model")
    assert run(["prepare", str(tmp_path / "model"), str(tmp_path / "prepared")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                              dtype=torch.float32)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["experts", "o_proj"]))
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(8))
    rows = [dict(input_ids=row, labels=row) for row in ids]
    args = transformers.TrainingArguments(tmp_path / "run", max_steps=30, learning_rate=2e-2, logging_steps=1,
                                          per_device_train_batch_size=4, save_steps=30, report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    curve = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert curve[-1] < 0.5 * curve[0], curve
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                              dtype=torch.float32)
    served = peft.PeftModel.from_pretrained(fresh, tmp_path / "run" / "checkpoint-30")
    with torch.no_grad():
        assert torch.equal(served(ids[:2]).logits, model(ids[:2]).logits)


def mxfp4_checkpoint(path):
    """A tiny GPT-OSS laid out as published: MXFP4 experts (random codes, exponents 2^-6 to 1) beside BF16 biases and
    other weights, and its quantization_config. I = 64: MXFP4 rows hold whole groups of 32."""
    config = transformers.GptOssConfig(**{**CONFIGS["gpt_oss"]().to_dict(), "intermediate_size": 64})
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(9)
    fused = ("experts.gate_up_proj", "experts.down_proj")
    state = {k: v for k, v in stock.state_dict().items() if not k.endswith(fused)}
    state = {k: torch.randn(v.shape, generator=g) if ".experts." in k else v for k, v in state.items()}
    for n in range(config.num_hidden_layers):
        for proj, rows, cols in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            key = f"model.layers.{n}.mlp.experts.{proj}"
            state[key + "_blocks"] = torch.randint(0, 256, (6, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            state[key + "_scales"] = torch.randint(121, 128, (6, rows, cols // 32), generator=g, dtype=torch.uint8)
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    path.mkdir()
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer_config.json").write_text("{}")


def test_mxfp4_decodes_as_transformers_does():
    g = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 80, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 80, 4), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # the module's [E, in, out]
    assert torch.equal(mxfp4.dequantize(blocks, scales), theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="scale is 255"):
        mxfp4.dequantize(blocks, scales.masked_fill(scales == 120, 255))


@pytest.mark.parametrize("expert_format", [None, "fp8", "int4"])
def test_a_published_mxfp4_checkpoint_prepares_and_matches_transformers(tmp_path, expert_format):
    # Read as published (each expert's codes decoded at load, exactly, into BF16, or quantized again to FP8 / INT4),
    # against transformers' own dequantization of the same checkpoint.
    mxfp4_checkpoint(tmp_path / "published")
    prepare(tmp_path / "published", tmp_path / "prepared", expert_format=expert_format)
    kt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                           dtype=torch.float32)
    assert {m.expert_format for m in kt.modules() if isinstance(m, KTExpertsLinear)} == {expert_format or "bf16"}
    stock = transformers.AutoModelForCausalLM.from_pretrained(  # its experts dequantized to BF16 whatever dtype says
        tmp_path / "published", quantization_config=transformers.Mxfp4Config(dequantize=True)).float()
    if expert_format:
        stock = stock_with_the_experts_of(stock, kt)
    ids = batch(10)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


def test_kt_sft_merge_refuses_mxfp4_experts(tmp_path):
    mxfp4_checkpoint(tmp_path / "published")
    prepare(tmp_path / "published", tmp_path / "prepared")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "prepared", trust_remote_code=True,
                                                              dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["experts"], init_lora_weights=False)
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="stored in MXFP4, which kt-sft merge does not write"):
        merge_adapter(tmp_path / "published", tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_gives_the_same_grads_with_one_engine_forward_per_layer(use_reentrant, monkeypatch):
    plain = grads(None, model_type="gpt_oss")
    calls = engine_forwards(monkeypatch)
    ckpt = grads({"use_reentrant": use_reentrant}, model_type="gpt_oss")
    assert len(calls) == 2  # the recompute found each layer's first pass kept
    assert plain.keys() == ckpt.keys() and any("experts.lora_A" in n for n in plain)
    for name, g in plain.items():
        assert rel_l2(ckpt[name], g) <= FP32_IO, name


def test_the_down_bias_follows_the_model_under_an_adapter():
    # The first adapter moves the expert weights and biases into the experts' base layer: the down bias, which only
    # PyTorch reads, must still follow the model's moves there (the engine's tensors stay in CPU RAM).
    kt, _ = kt_and_reference("gpt_oss")
    kt.to(torch.float64)
    for module in (m for m in kt.modules() if isinstance(m, KTExpertsLinear)):
        assert module.down_proj_bias.dtype == torch.float64
        assert module.gate_up_proj.dtype == torch.bfloat16 and module.gate_up_proj_bias.dtype == torch.float32


def test_what_cannot_be_done_with_gpt_oss_is_named(tmp_path):
    # kt-sft export: no runtime has per-expert GPT-OSS modules; kt-sft merge: an adapter's trained biases; the loader:
    # MXFP4 experts without the quantization_config that says so.
    save_checkpoint(tiny_model("gpt_oss"), tmp_path / "model")
    model = tiny_model("gpt_oss")
    use_cpu_experts(model)
    model.requires_grad_(False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["experts"], bias="all")
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="exist only fused .* no runtime has the per-expert modules"):
        export_adapter(tmp_path / "adapter", tmp_path / "exported", tmp_path / "model")
    # peft 0.21 also saves the router's bias, which it names first.
    with pytest.raises(ValueError, match=r"(down_proj_bias|router\.bias), a trained bias \(the adapter's bias='all'"):
        merge_adapter(tmp_path / "model", tmp_path / "adapter", tmp_path / "merged")
    mxfp4_checkpoint(tmp_path / "published")
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "published" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="experts in MXFP4 .* config.json has no MXFP4 quantization_config"):
        prepare(tmp_path / "published", tmp_path / "prepared")
    save_checkpoint(tiny_model("qwen3_moe"), tmp_path / "per_expert")  # an MXFP4 config over per-expert weights
    config = json.loads((tmp_path / "per_expert" / "config.json").read_text())
    (tmp_path / "per_expert" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="declares MXFP4 experts .* reads MXFP4 experts fused"):
        prepare(tmp_path / "per_expert", tmp_path / "prepared")
