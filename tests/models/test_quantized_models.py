"""Quantized checkpoints as published (FP8 DeepSeek-V3, INT4 Kimi-K2) and BF16 ones quantized at load, through
`kt-sft prepare` + AutoModelForCausalLM(trust_remote_code): experts stay quantized in the engine, logits equal
the stock model on the dequantized values, LoRA trains, full fine-tuning is refused, bad configs are named."""
import json
import re
import shutil

import peft
import pytest
import torch
import transformers

from kt_sft.cli import run
from kt_sft.loader.checkpoint import Checkpoint
from kt_sft.loader.quantization import read_weight
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import dequantized_copy, kimi_k25_checkpoint, quantize_checkpoint
from tiny_models import save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2

IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
# The attention and the routed experts: newer peft turns "all-linear" on MoE models into targets the experts refuse
# (test_peft_parity.py).
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts"]


def load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """fp8: a DeepSeek-V3 checkpoint in FP8 layout; int4: a Kimi-K2 one in RAWINT4 layout."""
    root = tmp_path_factory.mktemp("quantized")
    save_checkpoint(tiny_model("deepseek_v3"), root / "bf16")
    return {"fp8": quantize_checkpoint(root / "bf16", root / "fp8", "fp8"),
            "int4": quantize_checkpoint(root / "bf16", root / "int4", "int4", model_type="kimi_k2"),
            "bf16": root / "bf16"}


@pytest.mark.parametrize("fmt", ["fp8", "int4", "int4_dense"])
def test_published_quantized_checkpoint_loads_and_matches(published, tmp_path, fmt):
    out = tmp_path / "prepared"
    if fmt == "int4_dense":  # attention and dense MLPs packed too: dequantized at load, their shapes checked before
        fmt = "int4"
        published = {fmt: quantize_checkpoint(published["bf16"], tmp_path / "dense", fmt, "kimi_k2", int4_dense=True)}
        assert any(k.endswith("self_attn.o_proj.weight_packed") for k in Checkpoint(published[fmt]).keys())
    assert run(["prepare", str(published[fmt]), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and written["kt_sft"]["expert_format"] == fmt
    model = load(out)
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all(m.expert_format == fmt for m in experts)
    assert all(not hasattr(m, "weight_scale_inv") for m in model.modules())
    ref = load(dequantized_copy(published[fmt], tmp_path / "ref", "deepseek_v3"))
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO


def test_minimax_m2_fp8_as_published_loads_and_matches(tmp_path):
    # MiniMax-M2 publishes FP8 with fmt "float8_e4m3fn" (DeepSeek: "e4m3") and Mixtral's expert names (w1/w3/w2).
    save_checkpoint(tiny_model("minimax_m2"), tmp_path / "bf16")
    src = quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fp8")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], "fmt": "float8_e4m3fn",
                                     "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    assert any(k.endswith("block_sparse_moe.experts.0.w1.weight_scale_inv") for k in _keys(src))
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    model = load(tmp_path / "prepared")
    assert all(m.expert_format == "fp8" for m in model.modules() if isinstance(m, KTExpertsLinear))
    ref = load(dequantized_copy(src, tmp_path / "ref", "minimax_m2"))
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_bf16_checkpoint_quantized_at_load(published, tmp_path, fmt):
    out = tmp_path / "prepared"
    assert run(["prepare", str(published["bf16"]), str(out), "--expert-format", fmt]) == 0
    model = load(out)
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert all(m.expert_format == fmt for m in experts)
    ref = tiny_model("deepseek_v3")
    ours_exp = iter(experts)
    with torch.no_grad():
        for m in ref.modules():
            if type(m).__name__ in ("DeepseekV3NaiveMoe", "DeepseekV3Experts"):
                gu, dn = next(ours_exp).base_weights()
                m.gate_up_proj.copy_(gu)
                m.down_proj.copy_(dn)
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO


def test_fp8_checkpoint_dequantized_to_bf16_trains_fully(published, tmp_path):
    out = tmp_path / "prepared"
    assert run(["prepare", str(published["fp8"]), str(out), "--expert-format", "bf16"]) == 0
    model = load(out)
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert all(m.expert_format == "bf16" and m.gate_up_proj.requires_grad for m in experts)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    assert all(m.gate_up_proj.grad is not None and m.gate_up_proj.grad.abs().sum() > 0 for m in experts)


def test_lora_trains_on_quantized_experts_and_full_training_is_refused(published, tmp_path):
    out = tmp_path / "prepared"
    run(["prepare", str(published["fp8"]), str(out)])
    model = load(out).train()
    with pytest.raises(ValueError, match="routed experts are quantized and cannot train"):
        model(IDS, labels=IDS)
    lora = peft.get_peft_model(load(out).requires_grad_(False), peft.LoraConfig(r=4, lora_alpha=8,
                                                                                target_modules=LORA_TARGETS))
    lora.train()
    experts = [m for m in lora.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all("default" in m.lora_A for m in experts)
    lora(input_ids=IDS, labels=IDS).loss.backward()
    assert all(m.lora_B["default"]["down"].grad.abs().sum() > 0 for m in experts)
    lora.save_pretrained(tmp_path / "adapter")  # the adapter saves; a full save would write no experts (buffers
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()  # outside the state dict): refused
    # Base weights made trainable after good steps, and after an unload: had trained beside frozen experts.
    embeddings = lora.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(ValueError, match="base weights such as .*embed_tokens.weight are being trained"):
        lora(input_ids=IDS, labels=IDS)
    embeddings.requires_grad_(False)
    lora(input_ids=IDS, labels=IDS).loss.backward()
    base = lora.unload()
    with pytest.raises(ValueError, match="routed experts are FP8 .* save_pretrained would write a checkpoint without"):
        base.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(ValueError, match="routed experts are quantized and cannot train"):
        base.requires_grad_(True)(IDS, labels=IDS)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}, "'num_bits': 8"),
    ("fp8", "the value 'fp8' where an object is expected"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": "int4"}}, "the config group 'int4'"),
    # Accepted before and ignored: each changes what the stored tensors mean.
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
        "actorder": "group"}}}}, "'actorder': 'group'"),
    ({"quant_method": "compressed-tensors", "transform_config": {"config_groups": {}}}, "transform_config"),
    ({"quant_method": "compressed-tensors", "quantization_status": "frozen"}, "quantization_status 'frozen'"),
])
def test_unsupported_quantization_is_named(published, tmp_path, qc, match):
    cfg = json.loads((published["bf16"] / "config.json").read_text())
    cfg["quantization_config"] = qc
    (published["bf16"] / "config.json").write_text(json.dumps(cfg))
    try:
        with pytest.raises(ValueError, match=match + ".*kt_sft reads fp8"):
            run(["prepare", str(published["bf16"]), str(tmp_path / "out")])
    finally:
        cfg.pop("quantization_config")
        (published["bf16"] / "config.json").write_text(json.dumps(cfg))


def test_bf16_weights_under_a_quantization_config_are_named(published, tmp_path):
    # What DeepSeek's fp8_cast_bf16.py leaves: BF16 weights, config.json unchanged. The refusal had called one
    # expert unquantized among FP8 ones.
    src = tmp_path / "cast"
    save_checkpoint(tiny_model("deepseek_v3"), src)
    config = json.loads((src / "config.json").read_text())
    qc = json.loads((published["fp8"] / "config.json").read_text())["quantization_config"]
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match="declares FP8 weights .* holds no .weight_scale_inv tensors.*remove "
                                         "quantization_config"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_missing_scales_are_named(published, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "broken"
    quantize_checkpoint(published["bf16"], src, "fp8")
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale_inv"):
        run(["prepare", str(src), str(tmp_path / "out")])


def _rewrite(src, change):
    """The single-shard checkpoint in src with its tensors passed through change(state)."""
    from safetensors.torch import load_file, save_file
    state = load_file(str(src / "model.safetensors"))
    change(state)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})


def _keys(src):
    from safetensors import safe_open
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("fmt, message", [
    # Read as BF16, FP8 codes would have become the weights without their scales.
    ("fp8", r"experts\.0\.gate_proj\.weight is stored as F8_E4M3, but config.json has no quantization_config"),
    # INT4 experts were refused as missing the BF16 experts' keys, with config.json's layout to blame.
    ("int4", r"packed as INT4 \(.weight_packed\), but config.json has no quantization_config"),
])
def test_quantized_experts_without_their_quantization_config_are_refused(published, tmp_path, fmt, message):
    src = quantize_checkpoint(published["bf16"], tmp_path / "no_qc", fmt, model_type="kimi_k2" if fmt == "int4" else None)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_a_missing_scale_of_a_dense_fp8_weight_is_named(published, tmp_path):
    src = quantize_checkpoint(published["bf16"], tmp_path / "no_attn_scale", "fp8")
    key = next(k for k in _keys(src) if k.endswith("self_attn.o_proj.weight_scale_inv"))
    _rewrite(src, lambda state: state.pop(key))
    # From the shard headers, before any weight is read (the load had failed after reading the others).
    message = f"has no {re.escape(key)}, which {re.escape(key.removesuffix('_scale_inv'))} \\(FP8\\) needs beside it"
    with pytest.raises(ValueError, match=message):
        run(["prepare", str(src), str(tmp_path / "out")])


@pytest.mark.parametrize("fmt, suffix", [("fp8", "weight_scale_inv"), ("int4", "weight_scale"),
                                         ("int4", "weight_packed")])
def test_a_dense_quantized_weight_whose_parts_disagree_is_named(published, tmp_path, fmt, suffix):
    src = quantize_checkpoint(published["bf16"], tmp_path / "cut", fmt, "kimi_k2" if fmt == "int4" else None,
                              int4_dense=True)
    key = next(k for k in _keys(src) if k.endswith(f"self_attn.o_proj.{suffix}"))
    _rewrite(src, lambda state: state.update({key: state[key][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=re.escape(key) + r" has shape \[\d+, \d+\] where .* \(" + fmt.upper() +
                       r"\) of \[64, 64\] values implies"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_int4_weight_shape_of_any_expert_is_checked(published, tmp_path):
    src = quantize_checkpoint(published["bf16"], tmp_path / "bad_shape", "int4", model_type="kimi_k2")
    key = "model.layers.1.mlp.experts.3.gate_proj.weight_shape"
    _rewrite(src, lambda state: state[key].sub_(1))
    with pytest.raises(ValueError, match=re.escape(key) + " says"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_an_int4_weight_shape_that_is_not_whole_numbers_is_named(published, tmp_path):
    # Stored as floats, it reached the unpacking as a column count: a TypeError traceback where a weight is read
    # whole (kt-sft merge; a dense INT4 weight at load).
    src = quantize_checkpoint(published["bf16"], tmp_path / "float_shape", "int4", model_type="kimi_k2")
    key = "model.layers.1.mlp.experts.3.gate_proj.weight_shape"
    _rewrite(src, lambda state: state.__setitem__(key, state[key].float()))
    message = re.escape(key) + r" is \[.*\] \(torch.float32\), where .* must be two whole numbers"
    with pytest.raises(ValueError, match=message):
        read_weight(Checkpoint(src), key.replace("weight_shape", "weight_packed"))


def test_int4_codes_stored_in_another_integer_type_are_named_by_their_type(published, tmp_path):
    # Checked for their shape first, they were refused as disagreeing with config.json.
    src = quantize_checkpoint(published["bf16"], tmp_path / "bytes", "int4", model_type="kimi_k2")
    key = "model.layers.1.mlp.experts.3.gate_proj.weight_packed"
    _rewrite(src, lambda state: state.__setitem__(key, state[key].view(torch.uint8).clone()))
    with pytest.raises(ValueError, match=re.escape(key) + " is stored as U8, where int4 experts keep I32"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_int4_scales_that_are_not_bf16_are_refused(published, tmp_path):
    # The engine keeps group scales in BF16: float16 or float32 ones would have been rounded without a word.
    from safetensors.torch import load_file, save_file
    src = tmp_path / "f16_scales"
    quantize_checkpoint(published["bf16"], src, "int4")
    state = load_file(str(src / "model.safetensors"))
    state = {k: v.half() if k.endswith(".weight_scale") else v for k, v in state.items()}
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight_scale is F16; kt_sft reads INT4 group scales"):
        run(["prepare", str(src), str(tmp_path / "out")])


@pytest.mark.parametrize("quantization_in_text", [False, True])
def test_kimi_k25_composite_checkpoint_serves_its_text_model(published, tmp_path, quantization_in_text):
    """Kimi-K2.5 as published (quantized_checkpoints.kimi_k25_checkpoint): its text model is served."""
    src = kimi_k25_checkpoint(published["bf16"], tmp_path / "k25", quantization_in_text)
    text = json.loads((src / "config.json").read_text())["text_config"]
    assert ("quantization_config" in text) == quantization_in_text
    out = tmp_path / "prepared"
    assert run(["prepare", str(src), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["kt_sft"]["source_model_type"] == "kimi_k25"
    assert written["kt_sft"]["checkpoint_prefix"] == "language_model."
    model = load(out)
    assert all(m.expert_format == "int4" for m in model.modules() if isinstance(m, KTExpertsLinear))
    ref = load(dequantized_copy(published["int4"], tmp_path / "ref", "deepseek_v3"))
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO


def test_merging_into_quantized_experts_is_refused_and_unloading_keeps_them(published, tmp_path):
    out = tmp_path / "prepared"
    run(["prepare", str(published["int4"]), str(out)])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    lora = peft.get_peft_model(load(out).requires_grad_(False), config)
    experts = [m for m in lora.modules() if isinstance(m, KTExpertsLinear)]
    with pytest.raises(ValueError, match="merging LoRA into INT4 experts would requantize them"):
        experts[0].merge()
    assert not experts[0].merged
    tuned = [m for m in lora.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    with torch.no_grad():
        adapted = lora(IDS).logits
        # PEFT merges module by module: refused before the attention's LoRA, met first, had merged (or been unloaded).
        for merge in (lora.merge_adapter, lora.merge_and_unload):
            with pytest.raises(ValueError, match="merging LoRA into INT4 experts would requantize them"):
                merge()
            assert [m for m in lora.modules() if isinstance(m, peft.tuners.lora.LoraLayer)] == tuned
            assert not any(m.merged for m in tuned)
            assert torch.equal(lora(IDS).logits, adapted)
        with lora.disable_adapter():
            base = lora(IDS).logits
        plain = lora.unload()
        assert not any(m.lora_A for m in plain.modules() if isinstance(m, KTExpertsLinear))
        assert torch.equal(plain(IDS).logits, base)
    # Marked as transformers marks a quantized model: LLaMA-Factory then serves an adapter unmerged.
    assert plain.quantization_method == "compressed-tensors"


def test_an_adapter_without_the_experts_merges_beside_quantized_experts(published, tmp_path):
    out = tmp_path / "prepared"
    run(["prepare", str(published["fp8"]), str(out)])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(load(out).requires_grad_(False), config)
    lora.add_adapter("experts_too", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"]))
    tuned = [m for m in lora.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    with torch.no_grad():
        adapted = lora(IDS).logits
        # Named, not active: refused before the attention's LoRA merges it.
        with pytest.raises(ValueError, match="merging LoRA into FP8 experts would requantize them"):
            lora.merge_adapter(adapter_names=["experts_too"])
        assert not any(m.merged for m in tuned)
        lora.delete_adapter("experts_too")
        merged = lora.merge_and_unload()
        assert rel_l2(merged(IDS).logits, adapted) <= FP32_IO


def test_a_dense_weight_beside_fp8_scales_in_another_dtype_is_refused(published, tmp_path):
    # Read as plain numbers, its codes had become the weight (448 where 0.07 was meant) and its scale was dropped.
    src = quantize_checkpoint(published["bf16"], tmp_path / "e5m2", "fp8")
    key = next(k for k in _keys(src) if k.endswith("self_attn.o_proj.weight"))
    _rewrite(src, lambda state: state.update({key: state[key].to(torch.float8_e5m2)}))
    with pytest.raises(ValueError, match=re.escape(key) + r" is F8_E5M2 beside its FP8 scales"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_tensors_beside_the_experts_that_the_loader_would_skip_are_refused(published, tmp_path):
    # A weight_g_idx (actorder) or zero point under the experts' prefix had been skipped without a word.
    src = quantize_checkpoint(published["bf16"], tmp_path / "g_idx", "int4", model_type="kimi_k2")
    key = "model.layers.1.mlp.experts.2.down_proj.weight_g_idx"
    _rewrite(src, lambda state: state.update({key: torch.zeros(8, dtype=torch.int32)}))
    with pytest.raises(ValueError, match=re.escape(key) + " beside layer 1's int4 experts, which kt_sft does not "
                                         "read"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_a_dense_weight_of_another_shape_is_named(published, tmp_path):
    src = tmp_path / "narrow"
    src.mkdir()
    for f in published["bf16"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    key = next(k for k in _keys(src) if k.endswith("self_attn.o_proj.weight"))
    assert run(["prepare", str(src), str(tmp_path / "out")]) == 0
    _rewrite(src, lambda state: state.update({key: state[key][:, :-2].contiguous()}))
    message = re.escape(key) + r" has shape \[64, 62\] but config.json implies \[64, 64\]"
    with pytest.raises(ValueError, match=message):  # from the shard's header, before any weight is read
        load(tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        run(["prepare", str(src), str(tmp_path / "again")])


def test_a_checkpoint_without_the_routing_bias_is_refused(published, tmp_path):
    # DeepSeek-V3's e_score_correction_bias is a buffer: a checkpoint without it had loaded with the bias at zeros,
    # routing tokens to other experts than the published model, without a word.
    src = tmp_path / "no_bias"
    shutil.copytree(published["bf16"], src)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    _rewrite(src, lambda state: state.pop(key))
    with pytest.raises(ValueError, match=f"the checkpoint lacks {re.escape(key)}, which the deepseek_v3 model"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_quantized_experts_stored_fused_are_refused(published, tmp_path):
    # BF16 experts stored fused are read (test_prepare_load); FP8 ones have no published fused layout to read.
    src = tmp_path / "fused_fp8"
    shutil.copytree(published["fp8"], src)
    p = "model.layers.1.mlp.experts."

    def fuse(state):
        for name in [k for k in state if k.startswith(p)]:
            state.pop(name)
        state[p + "gate_up_proj"] = torch.zeros(8, 80, 64).to(torch.float8_e4m3fn)
        state[p + "down_proj"] = torch.zeros(8, 64, 40).to(torch.float8_e4m3fn)

    _rewrite(src, fuse)
    with pytest.raises(ValueError, match=r"stores layer 1's FP8 routed experts fused \(" + re.escape(p)):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_a_bad_expert_value_names_its_layer(published, tmp_path):
    src = tmp_path / "nan_expert"
    src.mkdir()
    for f in published["bf16"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(src, lambda state: state[key].view(-1).__setitem__(0, float("nan")))
    assert run(["prepare", str(src), str(tmp_path / "out"), "--expert-format", "int4"]) == 0
    with pytest.raises(ValueError, match="layer 1's routed experts: expert 3's up weight holds NaN or Inf"):
        load(tmp_path / "out")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_an_expert_left_unquantized_is_named(published, tmp_path, fmt):
    # A quantization_config that leaves some experts out (an `ignore` list): refused as a dtype or key mismatch
    # that blamed config.json before.
    src = quantize_checkpoint(published["bf16"], tmp_path / "mixed", fmt, model_type="kimi_k2" if fmt == "int4" else None)
    base = "model.layers.1.mlp.experts.2.up_proj"

    def unquantize(state):
        shape = state[base + ".weight_shape"].tolist() if fmt == "int4" else list(state[base + ".weight"].shape)
        for suffix in (".weight", ".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_shape"):
            state.pop(base + suffix, None)
        state[base + ".weight"] = torch.zeros(shape, dtype=torch.bfloat16)

    _rewrite(src, unquantize)
    with pytest.raises(ValueError, match=re.escape(base) + r"\.weight is stored unquantized among the checkpoint's"):
        run(["prepare", str(src), str(tmp_path / "out")])
