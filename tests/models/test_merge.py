"""`kt-sft merge`: a trained adapter merged into the published checkpoint, each weight in its own format. Float weights
give the unmerged model's logits; FP8 and INT4 weights hold exactly the format's quantization of the decoded weight
plus the adapter's update on the published grid (formats' requantize; the update computed here from the trained
modules, not from the adapter file); every other tensor
and file is unchanged, and the result loads; what the merge cannot do is named, leaving nothing behind."""
import json
import re
import shutil

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kt_sft.cli import run
from kt_sft.formats import fp8_block, int4_group
from kt_sft.integrations.merge import merge_adapter
from kt_sft.loader.checkpoint import Checkpoint
from kt_sft.loader.quantization import COMPANION_SUFFIXES, read_weight
from kt_sft.models import architecture_of, use_cpu_experts
from kt_sft.ops.reference import PROJECTIONS
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import kimi_k25_checkpoint
from test_export_adapter import trained_adapter
from test_quantized_models import IDS, LORA_TARGETS, load, published  # noqa: F401 (published: the fixture)
from test_llama4 import batch as llama4_batch
from test_peft_parity import kt_and_reference
from tiny_models import (auto_class, image_batch, qwen3_5_moe_published, qwen3_vl_moe_published, save_checkpoint,
                         tiny_model)
from tolerances import FP32_IO, MERGED_BF16, rel_l2


def updates_of(peft_model) -> dict:
    """Checkpoint weight key -> the adapter's update (float32), from the modules that trained it. The tests' scaling
    alpha / r = 2 is a power of two, so where it is applied does not change a bit of the update."""
    arch = architecture_of(peft_model.config)
    out = {}
    for name, m in peft_model.named_modules():
        if isinstance(m, KTExpertsLinear):
            layer = int(name.split("layers.")[1].split(".")[0])
            a, b, s = m.lora_A["default"], m.lora_B["default"], m.scaling["default"]
            for e in range(m.num_experts):
                for proj in m.projections:
                    key = arch.expert_key(layer, e, PROJECTIONS.index(proj))
                    out[key] = s * b[proj][e].float() @ a[proj][e].float()
        elif isinstance(m, peft.tuners.lora.LoraLayer) and "default" in m.lora_A:
            out[arch.checkpoint_name(name.removeprefix("base_model.model.") + ".weight")] = \
                m.get_delta_weight("default").float()
    return out


# Mixtral's and Phi's name experts w1/w3/w2; Nemotron-H's have no gate, under backbone.; InternVL's under LLaVA's
# language_model.model.
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "phimoe", "nemotron_h", "internvl"])
def test_float_checkpoint_merged_gives_the_unmerged_logits(tmp_path, model_type):
    peft_model, model_dir = trained_adapter(model_type, tmp_path)
    (model_dir / "consolidated.00.pth").write_bytes(b"other weights")  # left out: they would be unmerged
    (model_dir / "original").mkdir()
    # Not read (the single file is, as transformers reads it), so not written: it had been copied, naming no shard.
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    assert run(["merge", str(model_dir), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    merged = auto_class(model_type).from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(merged(IDS).logits, peft_model(input_ids=IDS).logits) <= FP32_IO
    before, after = Checkpoint(model_dir), Checkpoint(tmp_path / "merged")
    assert set(before.keys()) == set(after.keys())
    changed = {k for k in before.keys() if not torch.equal(before.get(k), after.get(k))}
    assert changed == set(updates_of(peft_model))
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == sorted(
        p.name for p in model_dir.iterdir()
        if p.name not in ("consolidated.00.pth", "original", "model.safetensors.index.json"))


# GPT-OSS's module holds its experts transposed, gate's and up's outputs interleaved; transformers 5.6's Granite as
# input_linear / output_linear; Nemotron-H's up_proj without a gate: a merged save_pretrained keeps the stock layout
# and names, which stock loads.
@pytest.mark.parametrize("model_type", ["gpt_oss", "granitemoeshared", "nemotron_h"])
def test_a_merged_save_loads_in_stock_transformers_with_the_adapters_logits(tmp_path, model_type):
    kt, _ = kt_and_reference(model_type)
    with torch.no_grad():
        adapter = kt(IDS).logits
    merged = kt.merge_and_unload()
    shapes = {k: t.shape for k, t in tiny_model(model_type).state_dict().items()}
    assert {k: t.shape for k, t in merged.state_dict().items()} == shapes
    merged.save_pretrained(tmp_path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(stock(IDS).logits, adapter) <= MERGED_BF16


def nemotron_h_fused(path):
    """The tiny nemotron_h saved with each layer's experts fused (up_proj, down_proj) under the published names
    (backbone.…, its embeddings as NVIDIA's and transformers 5.17's saves name them): no gate rows in its fused stack."""
    model = tiny_model("nemotron_h")
    save_checkpoint(model, path)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    save_file({re.sub(r"^model\.", "backbone.", k): v.contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})


# Each writes the tiny model's weights as published (Nemotron-H's fused as it is not, for its experts without a gate).
PUBLISHED = {"qwen3_vl_moe": qwen3_vl_moe_published, "qwen3_5_moe": qwen3_5_moe_published,
             "llama4": lambda path: save_checkpoint(tiny_model("llama4"), path),
             "gpt_oss": lambda path: save_checkpoint(tiny_model("gpt_oss"), path),
             "granitemoehybrid": lambda path: save_checkpoint(tiny_model("granitemoehybrid"), path),
             "gemma4": lambda path: save_checkpoint(tiny_model("gemma4"), path), "nemotron_h": nemotron_h_fused,
             "mistral3": lambda path: save_checkpoint(tiny_model("mistral3"), path)}
EXPERTS = {"llama4": "language_model.model.layers.{n}.feed_forward.experts.{p}",
           "gpt_oss": "model.layers.{n}.mlp.experts.{p}",
           "granitemoehybrid": "model.layers.{n}.block_sparse_moe.{p}",
           "gemma4": "model.language_model.layers.{n}.experts.{p}",
           "nemotron_h": "backbone.layers.{n}.mixer.experts.{p}",
           "mistral3": "language_model.model.layers.{n}.mlp.experts.{p}"}
# The fused tensors' names, where they are not gate_up_proj and down_proj.
FUSED_NAMES = {"granitemoehybrid": ("input_linear.weight", "output_linear.weight"),
               "nemotron_h": ("up_proj", "down_proj")}
MOE_LAYERS = {"nemotron_h": (1, 3), "mistral3": (1,)}  # the others': 0 and 1
BATCHES = {"llama4": lambda: llama4_batch(3), "gpt_oss": lambda: {"input_ids": IDS},
           "granitemoehybrid": lambda: {"input_ids": IDS}, "gemma4": lambda: {"input_ids": IDS},
           "nemotron_h": lambda: {"input_ids": IDS}, "mistral3": lambda: {"input_ids": IDS}}


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_fused_checkpoint_merged_gives_the_unmerged_logits_with_its_experts_still_fused(tmp_path, model_type):
    # Qwen3.5-MoE publishes its experts fused as the module holds them, Qwen3-VL-MoE fused and transposed, Llama 4
    # fused and transposed as its module holds them, GPT-OSS (a text model) too, gate's and up's rows alternating,
    # Granite as input_linear and output_linear beside the router, Gemma 4's in its decoder layers (no MoE block),
    # Nemotron-H's up_proj without gate rows, Mistral Small 4's under LLaVA's names:
    # each expert's update goes into its slice, in the checkpoint's layout, and stock transformers loads the result.
    PUBLISHED[model_type](tmp_path / "model")
    model = tiny_model(model_type)  # the published weights
    use_cpu_experts(model)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    peft_model = peft.get_peft_model(model.requires_grad_(False), lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert run(["merge", str(tmp_path / "model"), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    before, after = Checkpoint(tmp_path / "model"), Checkpoint(tmp_path / "merged")
    assert set(before.keys()) == set(after.keys())
    assert all(before.shape(k) == after.shape(k) for k in before.keys())
    changed = {k for k in before.keys() if not torch.equal(before.get(k), after.get(k))}
    experts = EXPERTS.get(model_type, "model.language_model.layers.{n}.mlp.experts.{p}")
    assert {k for k in changed if "o_proj" not in k} == {experts.format(n=n, p=p)
                                                         for n in MOE_LAYERS.get(model_type, (0, 1))
                                                         for p in FUSED_NAMES.get(model_type, ("gate_up_proj",
                                                                                               "down_proj"))}
    merged = auto_class(model_type).from_pretrained(tmp_path / "merged", dtype=torch.float32)
    batch = BATCHES.get(model_type, lambda: image_batch(0))()
    batch = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        assert rel_l2(merged(**batch).logits, peft_model(**batch).logits) <= FP32_IO


def merged_random_adapter(published_dir, tmp_path, targets):
    """Prepares published_dir, merges a random (non-zero) LoRA on `targets` into tmp_path/merged. Returns (the PEFT
    model, the merge report, the published and the merged Checkpoint), their keys, dtypes and shapes checked
    equal."""
    prepared = tmp_path / "prepared"
    assert run(["prepare", str(published_dir), str(prepared)]) == 0
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(load(prepared).requires_grad_(False), config)
    model.save_pretrained(tmp_path / "adapter")
    report = merge_adapter(prepared, tmp_path / "adapter", tmp_path / "merged")
    src, out = Checkpoint(published_dir), Checkpoint(tmp_path / "merged")
    assert {k: (src.dtype(k), src.shape(k)) for k in src.keys()} == {k: (out.dtype(k), out.shape(k)) for k in out.keys()}
    return model, report, src, out


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_checkpoint_merged_in_its_own_format(published, tmp_path, fmt):  # noqa: F811
    model, report, src, out = merged_random_adapter(published[fmt], tmp_path, LORA_TARGETS)
    updates = updates_of(model)
    merged = 0
    for key in src.keys():
        if key.endswith(COMPANION_SUFFIXES):
            continue
        weight, values = read_weight(src, key)
        if weight not in updates:
            assert torch.equal(out.get(key), src.get(key)), key
            continue
        merged += 1
        want = values.float() + updates[weight]
        base = weight.removesuffix(".weight")
        if key.endswith(".weight_packed"):
            packed, scale = int4_group.requantize(want, src.get(base + ".weight_scale"), base=values)
            assert torch.equal(out.get(key), packed) and torch.equal(out.get(base + ".weight_scale"), scale), key
        elif src.dtype(key) == "F8_E4M3":
            q, scale_inv = fp8_block.requantize(want, src.get(base + ".weight_scale_inv"), base=values)
            assert torch.equal(out.get(key).view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(out.get(base + ".weight_scale_inv"), scale_inv), key
        else:
            assert torch.equal(out.get(key), want.to(src.get(key).dtype)), key
    assert merged == len(updates) == sum(report.merged.values())
    # FP8 checkpoints hold every linear projection in FP8; INT4 ones the routed experts only.
    assert set(report.merged) == ({fmt} if fmt == "fp8" else {fmt, "float32"})
    assert all(0 <= report.relative_error(f) < 1.5 for f in report.merged)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        json.loads((published[fmt] / "config.json").read_text())["quantization_config"]["quant_method"]

    assert run(["prepare", str(tmp_path / "merged"), str(tmp_path / "reprepared")]) == 0
    with torch.no_grad():
        assert torch.isfinite(load(tmp_path / "reprepared")(IDS).logits).all()


def test_merge_refuses_a_checkpoint_that_prepare_refuses(published, tmp_path):  # noqa: F811
    # FP8 scales in float64 had been merged and written as float64, a checkpoint kt_sft then could not read.
    src = tmp_path / "fp8"
    shutil.copytree(published["fp8"], src)
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    peft.get_peft_model(load(tmp_path / "prepared").requires_grad_(False), config).save_pretrained(tmp_path / "adapter")
    key = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    state = load_file(str(src / "model.safetensors"))
    save_file({**state, key: state[key].double()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    message = re.escape(key) + " is stored as F64, where fp8 experts keep F32 or BF16 or F16"
    with pytest.raises(ValueError, match=message):
        run(["prepare", str(src), str(tmp_path / "again")])
    with pytest.raises(ValueError, match=message):
        run(["merge", str(tmp_path / "prepared"), str(tmp_path / "adapter"), str(tmp_path / "merged")])
    assert not (tmp_path / "merged").exists()


def test_merge_names_a_weight_as_the_checkpoint_does(tmp_path):
    # Qwen3.5-MoE's text model keeps the module tree's names when saved on its own (model.layers.N), where its
    # published checkpoint has model.language_model.layers.N: merge had looked for the latter only and refused an
    # o_proj LoRA as naming no weight of the checkpoint.
    from kt_sft.integrations.merge import checkpoint_key
    from tiny_models import save_checkpoint, tiny_model
    save_checkpoint(tiny_model("qwen3_5_moe_text"), tmp_path / "text")
    arch = architecture_of(tiny_model("qwen3_5_moe_text").config)
    module = "model.layers.1.self_attn.o_proj"
    assert checkpoint_key(arch, module, Checkpoint(tmp_path / "text"), "") == module + ".weight"
    published = tmp_path / "published"
    published.mkdir()
    state = load_file(str(tmp_path / "text" / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in state.items()},
              str(published / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_key(arch, module, Checkpoint(published), "") == \
        "model.language_model.layers.1.self_attn.o_proj.weight"


def reshard(directory, shards=3):
    """The checkpoint's single file split into `shards` files with an index, keys dealt round-robin (so a weight and
    its scales mostly sit in different shards)."""
    state = load_file(str(directory / "model.safetensors"))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {k: names[i % shards] for i, k in enumerate(sorted(state))}
    for name in names:
        save_file({k: v for k, v in state.items() if weight_map[k] == name}, str(directory / name),
                  metadata={"format": "pt"})
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_merges_across_shards(published, tmp_path):  # noqa: F811
    src = tmp_path / "fp8"
    shutil.copytree(published["fp8"], src)
    reshard(src)
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    model = peft.get_peft_model(load(tmp_path / "prepared").requires_grad_(False), config)
    model.save_pretrained(tmp_path / "adapter")
    seen = []
    merge_adapter(tmp_path / "prepared", tmp_path / "adapter", tmp_path / "merged",
                  progress=lambda done, total, shard: seen.append((done, total, shard)))
    assert seen == [(i + 1, 3, f"model-{i + 1:05d}-of-00003.safetensors") for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == sorted(p.name for p in src.iterdir())
    before, after = Checkpoint(src), Checkpoint(tmp_path / "merged")
    assert before.shard_of == after.shard_of
    updates = updates_of(model)
    for key in before.keys():
        if key.endswith(COMPANION_SUFFIXES):
            continue
        weight, values = read_weight(before, key)
        if weight in updates:
            q, scale_inv = fp8_block.requantize(values + updates[weight], before.get(key + "_scale_inv"))
            assert torch.equal(after.get(key).view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(after.get(key + "_scale_inv"), scale_inv), key
        else:
            assert torch.equal(after.get(key), before.get(key)), key


def test_composite_checkpoint_merges_its_text_model(published, tmp_path):  # noqa: F811
    src = kimi_k25_checkpoint(published["bf16"], tmp_path / "k25")
    assert run(["prepare", str(src), str(tmp_path / "prepared")]) == 0
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    model = peft.get_peft_model(load(tmp_path / "prepared").requires_grad_(False), config)
    model.save_pretrained(tmp_path / "adapter")
    merge_adapter(tmp_path / "prepared", tmp_path / "adapter", tmp_path / "merged")
    before, after = Checkpoint(src), Checkpoint(tmp_path / "merged")
    changed = {read_weight(before, k)[0] for k in before.keys()
               if not k.endswith(COMPANION_SUFFIXES) and not torch.equal(before.get(k), after.get(k))}
    assert changed == {"language_model." + k for k in updates_of(model)}
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "kimi_k25"


def test_adapter_carrying_its_base_embedding_weights_merges(tmp_path):
    # LoRA on lm_head: PEFT saves lm_head's whole base weight beside the pair (save_embedding_layers), which merge had
    # refused as a trained module although it is the checkpoint's own; one that differs is named, nothing written.
    peft_model, model_dir = trained_adapter("qwen3_moe", tmp_path, targets=("experts", "o_proj", "lm_head"))
    adapter = tmp_path / "adapter"
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.base_layer.weight" in lora
    assert run(["merge", str(model_dir), str(adapter), str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(merged(IDS).logits, peft_model(input_ids=IDS).logits) <= FP32_IO
    head = lora["base_model.model.lm_head.base_layer.weight"]
    embed = peft_model.get_input_embeddings().weight.detach()
    for copies, what in (({"base_model.model.lm_head.base_layer.weight": head + 1}, "other than the checkpoint's"),
                         ({"base_model.model.model.embed_tokens.weight": torch.cat([embed, embed[:2]])},
                          r"resized from \[\d+, \d+\] to")):
        save_file({**lora, **copies}, str(adapter / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=what):
            merge_adapter(model_dir, adapter, tmp_path / "out")
    # A module trained whole (modules_to_save; LLaMA-Factory's additional_target) is saved at the same key, as PEFT
    # 0.18.1 and 0.21 write it: named as such, not as a changed copy.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    trained = {k: v for k, v in lora.items() if ".lm_head." not in k}
    save_file({**trained, "base_model.model.lm_head.weight": head + 1}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"holds base_model\.model\.lm_head\.weight, a whole trained module"):
        merge_adapter(model_dir, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_lora_on_lm_head_merges_under_llavas_name(tmp_path):
    # InternVL's lm_head is the checkpoint's language_model.lm_head: its LoRA and the copy PEFT saves of its base
    # weight are found there.
    peft_model, model_dir = trained_adapter("internvl", tmp_path, targets=("experts", "o_proj", "lm_head"))
    assert run(["merge", str(model_dir), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    before, after = Checkpoint(model_dir), Checkpoint(tmp_path / "merged")
    assert not torch.equal(before.get("language_model.lm_head.weight"), after.get("language_model.lm_head.weight"))
    merged = auto_class("internvl").from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(merged(IDS).logits, peft_model(input_ids=IDS).logits) <= FP32_IO


def test_merge_names_what_it_cannot_do(tmp_path):
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    adapter = tmp_path / "adapter"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        merge_adapter(model_dir, adapter, busy)

    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    state = load_file(str(other / "adapter_model.safetensors"))
    state = {k.replace("o_proj", "x_proj"): v for k, v in state.items()}
    save_file(state, str(other / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"x_proj, but the checkpoint .* has no such weight"):
        merge_adapter(model_dir, other, tmp_path / "out")

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA adapter"):
        merge_adapter(model_dir, other, tmp_path / "out")
    # PiSSA-style initialisations train beside changed base weights: merged into the published ones, the adapter
    # had given logits 38% off the trained model's with a report of success.
    for init, way_out in (("pissa", "pissa_convert: true"), ("pissa_niter_16", "pissa_convert: true"),
                          ("olora", "pissa_convert: true"), ("loftq", "unmerged on the quantized base")):
        (other / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": init}))
        with pytest.raises(ValueError, match=f"changes the base weights .* {way_out}"):
            merge_adapter(model_dir, other, tmp_path / "out")
    (other / "adapter_config.json").write_text(json.dumps(cfg))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for extra, what in (("base_model.model.model.embed_tokens.lora_embedding_A", "an embedding's LoRA"),
                        ("base_model.model.model.layers.0.self_attn.o_proj.lora_B.bias", "a LoRA bias"),
                        ("base_model.model.lm_head.modules_to_save.default.weight", "a whole trained module")):
        save_file({**lora, extra: torch.zeros(2, 2)}, str(other / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=f"holds {re.escape(extra)}, {what}"):
            merge_adapter(model_dir, other, tmp_path / "out")
    save_file({}, str(other / "adapter_model.safetensors"))  # had merged nothing and reported success
    with pytest.raises(ValueError, match="holds no LoRA matrices"):
        merge_adapter(model_dir, other, tmp_path / "out")
    # What the loader refuses to read, merge refuses too (it would have requantized as symmetric INT4).
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}}}))
    with pytest.raises(ValueError, match="'symmetric': False.*kt_sft reads"):
        merge_adapter(model_dir, adapter, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "busy", "model", "other"]
