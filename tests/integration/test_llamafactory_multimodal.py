"""Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V, Llama 4, Gemma 4, Qwen3-Omni's thinker, InternVL3.5 and Mistral Small 4 through
the stock `llamafactory-cli`, images included: a tiny checkpoint as published (Qwen's experts fused, Qwen3-VL-MoE's
and Llama 4's transposed; GLM's, Qwen3-Omni's and InternVL's per expert; Gemma 4's fused in its decoder layers;
Qwen3-Omni's thinker under `thinker.` in the whole model's checkpoint; processor and chat template beside it) is
prepared and LoRA-trained on questions about images (the vision tower beside the model's other modules, the routed
experts on the CPU engine); LLaMA-Factory's chat model with the adapter answers each image's colour as trained, and
its export merges the adapter into a checkpoint that stock transformers loads with the adapter's logits."""
import json
import subprocess
import sys

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors import safe_open

from image_text_checkpoint import COLOURS, PIXELS, write_image_data, write_image_text_moe
from kt_sft.integrations.prepare import prepare
from test_llamafactory import losses, run, write_yaml
from test_llamafactory_quantized import train_lora
from tolerances import MERGED_BF16, rel_l2

VISION = dict(image_max_pixels=PIXELS, image_min_pixels=32 * 32, trust_remote_code=True)
TEMPLATES = {"qwen3_vl_moe": "qwen3_vl_nothink", "qwen3_5_moe": "qwen3_5_nothink", "glm4v_moe": "glm4_5v",
             "llama4": "llama4", "gemma4": "gemma4", "qwen3_omni_moe": "qwen3_omni_nothink", "internvl": "intern_vl",
             "mistral3": "mistral_small"}
# LLaMA-Factory's chat model in a process of its own (as `llamafactory-cli chat` runs), asked about each image.
ASK = """import json, sys
from PIL import Image
from llamafactory.chat import ChatModel
args = json.loads(sys.argv[1])
chat = ChatModel(args["model"])
for path in args["images"]:
    reply = chat.chat([{"role": "user", "content": "<image>What colour is this?"}], images=[Image.open(path)])
    print(json.dumps(reply[0].response_text))
"""


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def trained(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(request.param)
    prepared = prepare(write_image_text_moe(root / "src", request.param), root / "prepared")
    data = write_image_data(root / "data")
    out = root / "run"
    vision = {**VISION, "template": TEMPLATES[request.param]}
    if request.param in ("glm4v_moe", "gemma4"):  # reasoning templates: the empty thinking goes into the prompt
        vision["enable_thinking"] = False
    # Mistral Small 4's tiny model (MLA, group-limited routing) takes more steps to learn the four answers whole.
    train_lora(prepared, root, out, dataset="kt_colours", **vision, per_device_train_batch_size=4,
               num_train_epochs=120 if request.param == "mistral3" else 60, learning_rate=3e-3)
    return root, prepared, data, out, vision


def test_lora_on_images_trains_every_layers_experts_and_leaves_the_vision_tower(trained):
    out = trained[3]
    curve = losses(out)
    assert curve[max(curve)] < 0.2 * curve[min(curve)], curve
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert {k.split("layers.")[1].split(".")[0] for k in keys if ".experts.lora_" in k} == {"0", "1"}
    # frozen: freeze_vision_tower (Qwen3-Omni's audio tower too)
    assert not [k for k in keys if ".visual." in k or "vision_model." in k or "vision_tower." in k
                or "audio_tower." in k]


def test_chat_with_the_adapter_answers_each_image_as_trained(trained):
    root, prepared, data, out, vision = trained
    model = {"model_name_or_path": str(prepared), "adapter_name_or_path": str(out), "finetuning_type": "lora",
             **vision, "infer_dtype": "float32"}
    p = subprocess.run([sys.executable, "-c", ASK, json.dumps({"model": model, "images": [
        str(data / f"{name}.png") for name in COLOURS]})], capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # GLM's template opens each answer with a newline.
    replies = [json.loads(line).strip() for line in p.stdout.splitlines() if line.startswith('"')]
    assert replies == [f"It is {name}." for name in COLOURS], replies


def test_export_merges_the_adapter_into_a_checkpoint_stock_transformers_loads(trained):
    root, prepared, data, out, vision = trained
    (root / "none.yaml").write_text("{}\n")
    export = write_yaml(root / "export.yaml", root / "none.yaml", model_name_or_path=str(prepared),
                        adapter_name_or_path=str(out), finetuning_type="lora", export_dir=str(root / "merged"),
                        export_device="cpu", **vision)
    run(["export", str(export)], root)
    processor = transformers.AutoProcessor.from_pretrained(root / "merged")
    from PIL import Image
    batch = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": Image.open(data / "red.png")},
                                      {"type": "text", "text": "What colour is this?"}]}],
        tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}  # Llama 4's processor: BF16
    stock = transformers.AutoModelForImageTextToText.from_pretrained(root / "merged", dtype=torch.float32)  # no kt_sft
    assert not any("KT" in type(m).__name__ for m in stock.modules())
    adapter = PeftModel.from_pretrained(transformers.AutoModelForImageTextToText.from_pretrained(
        prepared, trust_remote_code=True, dtype=torch.float32), out)
    with torch.no_grad():
        assert rel_l2(stock(**batch).logits, adapter(**batch).logits) <= MERGED_BF16
