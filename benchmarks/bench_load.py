"""Load benchmark: peak host RSS while `AutoModelForCausalLM.from_pretrained(prepared, trust_remote_code=True)`
streams a checkpoint into the engine, against the routed-expert bytes and the non-expert bytes.
The issue's bound: peak <= 1.15 x routed bytes + non-expert model + workspace.

  python benchmarks/bench_load.py --layers 4 --dir /tmp/kt_load   # writes a Qwen3-30B-A3B-shaped checkpoint
  python benchmarks/bench_load.py --layers 4 --dir /tmp/kt_load --expert-format fp8   # quantized at load

With --expert-format the routed bytes are those of that format (codes + scales), which the experts take in RAM.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import qwen3_30b_a3b  # noqa: E402

PROBE = """
import sys, time, torch, transformers
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS")
t0 = time.perf_counter()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16)
print(base, rss("VmHWM"), rss("VmRSS"), time.perf_counter() - t0)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/kt_load")
    ap.add_argument("--expert-format", choices=["bf16", "fp8", "int4"], default="bf16")
    args = ap.parse_args()
    root = Path(args.dir)
    src, prepared = root / "model", root / "prepared"
    config = qwen3_30b_a3b(args.layers)
    if not (src / "config.json").exists():
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(src, max_shard_size="2GB")
        del model
    from kt_sft.integrations.prepare import prepare

    prepare(src, prepared, expert_format=args.expert_format)
    weights = args.layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    non_expert = total - weights * 2
    # bytes per weight in RAM: BF16 2; FP8 1 + a float32 scale per 128x128 block; INT4 0.5 + a BF16 scale per 32
    routed = int(weights * {"bf16": 2, "fp8": 1 + 4 / 128**2, "int4": 0.5 + 2 / 32}[args.expert_format])
    out = subprocess.run([sys.executable, "-c", PROBE, str(prepared)], capture_output=True, text=True, check=True)
    base, peak, held, seconds = out.stdout.split()[-4:]
    base, peak, held = int(base), int(peak), int(held)
    print(f"{args.layers} layers: routed experts {routed / 1e9:.2f} GB ({args.expert_format}), non-expert "
          f"{non_expert / 1e9:.2f} GB, "
          f"load {float(seconds):.1f} s")
    bound = 1.15 * routed + non_expert
    print(f"peak RSS during load {(peak - base) / 1e9:.2f} GB = {(peak - base) / routed:.3f} x routed bytes; "
          f"bound 1.15 x routed + non-expert = {bound / 1e9:.2f} GB (peak is {(peak - base) / bound:.0%} of it); "
          f"held after load {(held - base) / 1e9:.2f} GB")

if __name__ == "__main__":
    main()
