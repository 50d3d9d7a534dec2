"""Qwen3-Omni (model_type qwen3_omni_moe): its thinker served from the whole checkpoint as published (the thinker's
weights under `thinker.` beside the talker's and the vocoder's, which are not read), its experts on the engine, and
images and audio through its towers, against the stock thinker and against stock transformers + PEFT."""
import json
import re

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kt_sft.cli import run
from kt_sft.formats import fp8_block
from kt_sft.loader import model as loader_model
from kt_sft.loader.checkpoint import Checkpoint
from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import FP8_CONFIG
from test_peft_parity import kt_and_reference, train_alike
from tiny_models import OMNI_SPEECH, omni_batch, qwen3_omni_published
from tolerances import FP32_IO, rel_l2


def inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def prepared(tmp_path):
    stock = qwen3_omni_published(tmp_path / "published")
    assert run(["prepare", str(tmp_path / "published"), str(tmp_path / "prepared")]) == 0
    return stock, tmp_path / "prepared"


def load(path):
    return transformers.AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)


def test_the_thinker_of_the_published_checkpoint_is_served_and_matches_with_images_and_audio(tmp_path, monkeypatch):
    stock, out = prepared(tmp_path)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen3_omni_moe_thinker"
    assert written["kt_sft"]["source_model_type"] == "qwen3_omni_moe"
    read = []
    real = loader_model.read_weight
    monkeypatch.setattr(loader_model, "read_weight",
                        lambda ckpt, key, *a, **kw: read.append(ckpt.prefix + key) or real(ckpt, key, *a, **kw))
    model = load(out)
    assert type(model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert sum(isinstance(m, KTExpertsLinear) for m in model.modules()) == 2
    assert read and not [k for k in read if ".experts." in k]  # the experts are read into the engine only
    assert all(k.startswith("thinker.") for k in read)  # the talker's and the vocoder's weights are never read
    batch = inputs(omni_batch(0))
    silent = {**batch, "input_features": torch.zeros_like(batch["input_features"])}
    with torch.no_grad():
        logits = model(**batch).logits
        assert rel_l2(logits, stock(**batch).logits) <= FP32_IO
        assert rel_l2(model(**silent).logits, logits) > 0.01  # the audio reaches the logits


def test_lora_training_steps_with_images_and_audio_match_reference():
    train_alike(*kt_and_reference("qwen3_omni_moe_thinker"), omni_batch)


def test_generation_about_audio_and_an_image_with_the_adapter_matches_the_reference():
    kt, ref = kt_and_reference("qwen3_omni_moe_thinker")
    batch = inputs(omni_batch(3, rows=1))
    out = [m.eval().generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True) for m in (kt, ref)]
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel_l2(torch.stack(out[0].logits), torch.stack(out[1].logits)) <= FP32_IO


def test_the_whole_model_loaded_by_transformers_is_refused_naming_its_thinker():
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "qwen3_omni_moe"})()
    with pytest.raises(ValueError, match=r"serves a qwen3_omni_moe model's thinker alone, not the whole model; run "
                                         r"`kt-sft prepare` .* or give kt_sft the loaded model's `\.thinker`"):
        use_cpu_experts(model)


def test_a_published_checkpoint_without_its_thinker_config_is_refused(tmp_path):
    qwen3_omni_published(tmp_path / "published")
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    del config["thinker_config"]
    (tmp_path / "published" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="declares model_type 'qwen3_omni_moe' but has no thinker_config"):
        run(["prepare", str(tmp_path / "published"), str(tmp_path / "prepared")])


def lora_on(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    return peft.get_peft_model(model.requires_grad_(False), config)


def test_merge_writes_the_whole_checkpoint_with_the_thinker_merged_and_the_speech_parts_as_they_were(tmp_path):
    _, out = prepared(tmp_path)
    peft_model = lora_on(load(out))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert run(["merge", str(out), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    before, after = Checkpoint(tmp_path / "published"), Checkpoint(tmp_path / "merged")
    assert set(before.keys()) == set(after.keys())
    changed = {k for k in before.keys() if not torch.equal(before.get(k), after.get(k))}
    assert changed and all(k.startswith("thinker.") and (".experts." in k or "o_proj" in k) for k in changed)
    assert all(torch.equal(after.get(k), v) for k, v in OMNI_SPEECH.items())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen3_omni_moe"
    # The merged thinker on its own, as stock transformers loads it (in float32: the engine would round the merged
    # experts to BF16).
    thinker = tmp_path / "thinker"
    thinker.mkdir()
    save_file({k.removeprefix("thinker."): after.get(k) for k in after.keys() if k.startswith("thinker.")},
              str(thinker / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in peft_model.config.to_dict().items() if k != "kt_sft"}
    (thinker / "config.json").write_text(json.dumps(config))
    batch = inputs(omni_batch(1))
    with torch.no_grad():
        assert rel_l2(load(thinker)(**batch).logits, peft_model(**batch).logits) <= FP32_IO


@pytest.mark.parametrize("model", ["prepared", "published"])
def test_export_names_the_thinkers_per_expert_modules(tmp_path, model):
    _, out = prepared(tmp_path)
    peft_model = lora_on(load(out))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "exported"), "--model", str(tmp_path / model)]) == 0
    exported = load_file(str(tmp_path / "exported" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "exported" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "o_proj", "up_proj"]
    experts = peft_model.base_model.model.model.layers[1].mlp.experts
    for proj in ("gate", "up", "down"):
        stacked = experts.lora_B["default"][proj].detach()
        for e in (0, 7):
            key = f"base_model.model.model.layers.1.mlp.experts.{e}.{proj}_proj.lora_B.weight"
            assert torch.equal(exported[key], stacked[e]), key


@pytest.mark.parametrize("where", ["top", "thinker_config"])
def test_fp8_experts_load_in_their_format_wherever_config_json_puts_the_quantization_config(tmp_path, where):
    # Each expert's projections in FP8 (weight + weight_scale_inv per 128x128 block), under `thinker.` as the BF16
    # release keeps them; the quantization_config at the top of config.json or in the thinker's. The stock thinker
    # takes the values the codes decode to.
    stock = qwen3_omni_published(tmp_path / "src")
    state, out = load_file(str(tmp_path / "src" / "model.safetensors")), {}
    expert = re.compile(r"thinker\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    for key, t in state.items():
        m = expert.fullmatch(key)
        if m is None:
            out[key] = t
            continue
        q, scale = fp8_block.quantize(t)
        out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
        layer, e, proj = int(m[1]), int(m[2]), m[3]
        experts = stock.model.layers[layer].mlp.experts
        rows = {"gate": slice(0, 40), "up": slice(40, 80)}.get(proj)
        with torch.no_grad():
            (experts.down_proj[e] if rows is None else experts.gate_up_proj[e, rows]).copy_(
                fp8_block.dequantize(q, scale))
    save_file(out, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (config if where == "top" else config["thinker_config"])["quantization_config"] = FP8_CONFIG
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert run(["prepare", str(tmp_path / "src"), str(tmp_path / "prepared")]) == 0
    model = load(tmp_path / "prepared")
    assert all(m.expert_format == "fp8" for m in model.modules() if isinstance(m, KTExpertsLinear))
    batch = inputs(omni_batch(2))
    with torch.no_grad():
        assert rel_l2(model(**batch).logits, stock(**batch).logits) <= FP32_IO
