"""compressed-tensors checkpoints as llm-compressor writes them, quantized by the compressed-tensors package itself:
FP8 (FP8_DYNAMIC with a scale per output channel, FP8_BLOCK with 128x128 blocks, one scale per tensor) and W4A16
(INT4 in groups of 64, every linear projection). The experts stay FP8 / INT4 in the engine with their scales exact
on its grid, logits equal the stock model on the values compressed-tensors decodes, LoRA trains, other formats
convert at load, `kt-sft merge` writes the checkpoint back in its own layout, and what the format cannot mean is
refused by name."""
import json

import peft
import pytest
import torch

from kt_sft.cli import run
from kt_sft.formats import fp8_block, int4_group
from kt_sft.loader.checkpoint import Checkpoint
from kt_sft.loader.quantization import checkpoint_format
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import dequantized_copy, quantize_checkpoint
from test_merge import merged_random_adapter, updates_of
from test_quantized_models import IDS, load
from tiny_models import CONFIGS, experts_rounded_to_bf16, model_class, save_checkpoint
from tolerances import FP32_IO, rel_l2

STRATEGIES = ["channel", "tensor", "block"]
FORMATS = STRATEGIES + ["w4a16"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A Qwen3-MoE checkpoint in each compressed-tensors FP8 strategy, its experts 136 wide (two 128-row blocks of
    gate and up, two 128-column blocks of down), and one in W4A16 with experts 128 wide (two groups of 64 per row of
    down: compressed-tensors packs only rows of whole groups); every linear projection quantized."""
    root = tmp_path_factory.mktemp("compressed")
    for name, width in (("bf16", 136), ("bf16_128", 128)):
        torch.manual_seed(0)
        config = CONFIGS["qwen3_moe"]()
        config.moe_intermediate_size = width
        save_checkpoint(experts_rounded_to_bf16(model_class(config).from_config(config, dtype=torch.float32)),
                        root / name)
    out = {s: quantize_checkpoint(root / "bf16", root / s, "fp8-" + s) for s in STRATEGIES}
    out["w4a16"] = quantize_checkpoint(root / "bf16_128", root / "w4a16", "int4-g64", int4_dense=True)
    return out


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, KTExpertsLinear)]


@pytest.mark.parametrize("strategy", FORMATS)
def test_compressed_checkpoint_loads_in_its_format_and_matches(published, tmp_path, strategy):
    ckpt = Checkpoint(published[strategy])
    assert ckpt.dtype("model.layers.0.mlp.experts.0.up_proj.weight_scale") == "BF16"
    assert run(["prepare", str(published[strategy]), str(tmp_path / "prepared")]) == 0
    model = load(tmp_path / "prepared")
    experts = experts_of(model)
    fmt = "int4" if strategy == "w4a16" else "fp8"
    assert experts and all(m.expert_format == fmt for m in experts)
    # A channel's scale spreads over blocks one row high (exact), the others' over 128x128 blocks; W4A16's groups of
    # 64 over the engine's groups of 32.
    E, H, I = experts[0].num_experts, experts[0].hidden_size, experts[0].intermediate_size
    assert experts[0].down_scale.shape == (E, H, 4) if fmt == "int4" else \
        experts[0].gate_up_scale.shape[2] == (I if strategy == "channel" else 2)
    ref = load(dequantized_copy(published[strategy], tmp_path / "ref", "qwen3_moe"))
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO

    lora = peft.get_peft_model(model.requires_grad_(False), peft.LoraConfig(r=4, lora_alpha=8,
                                                                            target_modules=TARGETS))
    lora.train()
    lora(input_ids=IDS, labels=IDS).loss.backward()
    assert all(m.lora_B["default"]["down"].grad.abs().sum() > 0 for m in experts)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_compressed_fp8_converts_at_load(published, tmp_path, fmt):
    assert run(["prepare", str(published["channel"]), str(tmp_path / "prepared"), "--expert-format", fmt]) == 0
    model = load(tmp_path / "prepared")
    experts = experts_of(model)
    assert all(m.expert_format == fmt for m in experts)
    ref = load(dequantized_copy(published["channel"], tmp_path / "ref", "qwen3_moe"))
    with torch.no_grad():
        for theirs, ours in zip((m for m in ref.modules() if type(m).__name__ == "Qwen3MoeExperts"), experts):
            gate_up, down = ours.base_weights()
            theirs.gate_up_proj.copy_(gate_up)
            theirs.down_proj.copy_(down)
        assert rel_l2(model(IDS).logits, ref(IDS).logits) <= FP32_IO


@pytest.mark.parametrize("strategy", FORMATS)
def test_compressed_checkpoint_merges_in_its_own_layout(published, tmp_path, strategy):
    model, report, src, out = merged_random_adapter(published[strategy], tmp_path, TARGETS)
    updates = updates_of(model)
    for weight, update in updates.items():
        base = weight.removesuffix(".weight")
        scales = src.get(base + ".weight_scale")
        if strategy == "w4a16":  # requantized on its groups of 64
            cols = update.shape[1]
            values = int4_group.dequantize(src.get(base + ".weight_packed"), scales, cols, group=64)
            packed, scale = int4_group.requantize(values + update, scales, base=values, group=64)
            assert torch.equal(out.get(base + ".weight_packed"), packed), weight
        else:
            values = fp8_block.dequantize(src.get(weight), scales.float())
            q, scale = fp8_block.requantize(values + update, scales, base=values)
            assert torch.equal(out.get(weight).view(torch.uint8), q.view(torch.uint8)), weight
        assert torch.equal(out.get(base + ".weight_scale"), scale), weight
    published_format = "int4-g64" if strategy == "w4a16" else "fp8-" + strategy
    assert sum(report.merged.values()) == len(updates) and set(report.merged) == {published_format}
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["quantization_config"] == \
        json.loads((published[strategy] / "config.json").read_text())["quantization_config"]
    assert run(["prepare", str(tmp_path / "merged"), str(tmp_path / "reprepared")]) == 0
    with torch.no_grad():
        assert torch.isfinite(load(tmp_path / "reprepared")(IDS).logits).all()


def _with_weights(config: dict, **changes) -> dict:
    group = config["config_groups"]["group_0"]
    return {**config, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **changes}}}}


def _prepare_with_config(published_dir, tmp_path, change):
    """`kt-sft prepare` of a copy of published_dir whose quantization_config is change(the published one)."""
    cfg = json.loads((published_dir / "config.json").read_text())
    cfg["quantization_config"] = change(cfg["quantization_config"])
    src = tmp_path / "src"
    src.mkdir()
    for f in published_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(json.dumps(cfg))
    return run(["prepare", str(src), str(tmp_path / "out")])


@pytest.mark.parametrize("change, match", [
    (dict(input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     r"input_activations \{.*'dynamic': False"),
    (dict(weights={"num_bits": 8, "type": "float", "symmetric": False, "strategy": "channel"}), "'symmetric': False"),
    (dict(weights={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128}),
     "'strategy': 'group'"),
    (dict(weights={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                   "block_structure": [64, 64]}), r"'block_structure': \[64, 64\]"),
    (dict(weights={"num_bits": 4, "type": "float", "symmetric": True, "strategy": "channel"}), "'num_bits': 4"),
])
def test_compressed_fp8_settings_that_change_meaning_are_refused(published, tmp_path, change, match):
    def changed(qc):
        return {**qc, "config_groups": {"group_0": {**qc["config_groups"]["group_0"], **change}}}

    with pytest.raises(ValueError, match=match + ".*kt_sft reads fp8"):
        _prepare_with_config(published["channel"], tmp_path, changed)


def test_compressed_fp8_scales_of_another_strategy_are_named(published, tmp_path):
    with pytest.raises(ValueError, match=r"weight_scale has shape \[\d+, 1\] but config.json implies \[1\]"):
        _prepare_with_config(published["channel"], tmp_path, lambda qc: _with_weights(qc, strategy="tensor"))


@pytest.mark.parametrize("actorder, group, match", [("group", 64, "'actorder': 'group'"),
                                                    (None, 48, "'group_size': 48")])
def test_w4a16_settings_that_change_meaning_are_refused(published, tmp_path, actorder, group, match):
    with pytest.raises(ValueError, match=match + ".*kt_sft reads fp8"):
        _prepare_with_config(published["w4a16"], tmp_path,
                             lambda qc: _with_weights(qc, actorder=actorder, group_size=group))


@pytest.mark.parametrize("preset, fmt", [
    ("FP8_DYNAMIC", "fp8-channel"), ("FP8_BLOCK", "fp8-block"), ("W4A16", "int4-g128"), ("W4AFP8", "int4-g128"),
    ("FP8", None), ("W4A16_ASYM", None), ("NVFP4", None), ("W8A8", None)])
def test_llm_compressor_presets_are_read_or_refused_by_name(preset, fmt):
    """The configs compressed-tensors writes for llm-compressor's preset schemes: FP8 with dynamic activations and
    INT4 weights (whatever dynamic activations they are run with) are read; static activation scales (FP8),
    zero points (W4A16_ASYM), FP4 and INT8 weights are refused."""
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    packed = scheme["weights"]["num_bits"] == 4 and scheme["weights"]["type"] == "int"
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized" if packed else "float-quantized",
          "quantization_status": "compressed", "config_groups": {"group_0": scheme}, "ignore": ["lm_head"],
          "kv_cache_scheme": None, "sparsity_config": {"format": "dense", "global_sparsity": 0.1}}
    if fmt is None:
        with pytest.raises(ValueError, match="kt_sft reads fp8"):
            checkpoint_format(qc)
    else:
        assert checkpoint_format(qc) == fmt
