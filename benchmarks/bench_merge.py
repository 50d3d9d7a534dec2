"""`kt-sft merge` on a synthetic checkpoint of one Qwen3-30B-A3B-shaped MoE layer (H=2048, I=768; E experts) in
BF16, FP8 block-128 or INT4 group-32 layout, with a random r=16 LoRA on every expert of `--update` relative size
(B·A's entries against the weights'): merge rate, and the relative L2 error with which the merged weights carry
the update (kt_sft/integrations/merge.py).

  python benchmarks/bench_merge.py [--experts 16] [--formats bf16,fp8,int4] [--update 0.1]
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from quantized_checkpoints import FP8_CONFIG, INT4_CONFIG  # noqa: E402

from kt_sft.formats import fp8_block, int4_group  # noqa: E402
from kt_sft.integrations.merge import merge_adapter  # noqa: E402

H, I, R = 2048, 768, 16
SHAPES = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def write_checkpoint(root: Path, fmt: str, E: int, g: torch.Generator) -> None:
    state = {}
    for e in range(E):
        for proj, shape in SHAPES.items():
            w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
            key = f"model.layers.0.mlp.experts.{e}.{proj}"
            if fmt == "int4":
                state[key + ".weight_packed"], state[key + ".weight_scale"] = int4_group.quantize(w)
                state[key + ".weight_shape"] = torch.tensor(list(shape))
            elif fmt == "fp8":
                state[key + ".weight"], state[key + ".weight_scale_inv"] = fp8_block.quantize(w)
            else:
                state[key + ".weight"] = w.bfloat16()
    root.mkdir(parents=True)
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I, "num_experts": E}
    if fmt != "bf16":
        config["quantization_config"] = FP8_CONFIG if fmt == "fp8" else INT4_CONFIG
    (root / "config.json").write_text(json.dumps(config))


def write_adapter(root: Path, E: int, update: float, g: torch.Generator) -> None:
    """A and B scaled so that scaling·B·A's entries are ~`update` times the weights' (std 1/sqrt(in))."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": R}))
    tensors = {}
    for proj, (out, inp) in (("gate", SHAPES["gate_proj"]), ("up", SHAPES["up_proj"]), ("down", SHAPES["down_proj"])):
        size = (update / inp**0.5 / R**0.5) ** 0.5  # each entry of B·A sums R products of two such entries
        tensors[f"base_model.model.model.layers.0.mlp.experts.lora_A.{proj}"] = torch.randn(E, R, inp, generator=g) * size
        tensors[f"base_model.model.model.layers.0.mlp.experts.lora_B.{proj}"] = torch.randn(E, out, R, generator=g) * size
    save_file(tensors, str(root / "adapter_model.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--update", type=float, default=0.1, help="the update's entries relative to the weights'")
    args = ap.parse_args()
    weights = args.experts * 3 * H * I
    for fmt in args.formats.split(","):
        g = torch.Generator().manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            write_checkpoint(root / "model", fmt, args.experts, g)
            write_adapter(root / "adapter", args.experts, args.update, g)
            t0 = time.perf_counter()
            report = merge_adapter(root / "model", root / "adapter", root / "merged")
            seconds = time.perf_counter() - t0
            shutil.rmtree(root / "merged")
        name = "bfloat16" if fmt == "bf16" else fmt
        print(f"{fmt}: {weights / 1e6:.0f} M weights in {seconds:.2f} s ({weights / seconds / 1e6:.0f} M weights/s, "
              f"{torch.get_num_threads()} threads); update {args.update:g} of the weights carried with a relative L2 "
              f"error of {report.relative_error(name):.3f}")


if __name__ == "__main__":
    main()
