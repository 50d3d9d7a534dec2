"""Qwen3-VL-MoE through the stock `llamafactory-cli`, images included: a tiny checkpoint as published (experts fused
and transposed, processor and chat template beside it) is prepared, LoRA-trained on questions about images (the
vision tower on the device beside the model, the routed experts on the CPU engine), and asked about each image with
the adapter through LLaMA-Factory's chat model: it answers each image's colour as trained."""
import json
import subprocess
import sys

from safetensors import safe_open

from image_text_checkpoint import COLOURS, PIXELS, write_image_data, write_qwen3_vl_moe
from kt_sft.integrations.prepare import prepare
from test_llamafactory import losses
from test_llamafactory_quantized import train_lora

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


def test_lora_on_images_through_llamafactory_answers_each_image(tmp_path):
    src = write_qwen3_vl_moe(tmp_path / "src")
    data = write_image_data(tmp_path / "data")
    prepared = prepare(src, tmp_path / "prepared")
    out = tmp_path / "run"
    vision = dict(dataset="kt_colours", template="qwen3_vl_nothink", image_max_pixels=PIXELS,
                  image_min_pixels=32 * 32, trust_remote_code=True)
    train_lora(prepared, tmp_path, out, **vision, per_device_train_batch_size=4, num_train_epochs=60,
               learning_rate=3e-3)
    curve = losses(out)
    assert curve[max(curve)] < 0.2 * curve[min(curve)], curve
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    layers = {k.split("layers.")[1].split(".")[0] for k in keys if ".mlp.experts.lora_" in k}
    assert layers == {"0", "1"}  # every layer's experts trained on the CPU engine
    assert not [k for k in keys if ".visual." in k]  # the vision tower stays frozen (LLaMA-Factory's default)

    model = {"model_name_or_path": str(prepared), "adapter_name_or_path": str(out), "finetuning_type": "lora",
             **vision, "infer_dtype": "float32"}
    p = subprocess.run([sys.executable, "-c", ASK, json.dumps({"model": model, "images": [
        str(data / f"{name}.png") for name in COLOURS]})], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    replies = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('"')]
    assert replies == [f"It is {name}." for name in COLOURS], replies
