"""End-to-end benchmark through the stock LLaMA-Factory: `llamafactory-cli train` LoRA SFT of a Qwen3-30B-A3B-shaped
model (random BF16 weights, --layers of its 48, written locally with a character-level tokenizer), every
sample cut at --seq tokens, routed experts on the CPU engine. Reads the per-step split that KT_SFT_PROFILE
prints and reports medians after the first two steps: step time, tokens/s, GPU peak, host RSS, and the step
against the CPU engine's time (forward with the checkpoint recompute, plus backward).

  python benchmarks/bench_lf.py --layers 4 --seq 2048 --steps 8 --work /tmp/kt_lf_bench

All 48 layers (a 61 GB checkpoint) on a 64 GB disk: --quick-init, and --output-dir on /dev/shm for the 3.3 GB
adapter LLaMA-Factory saves at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from bench_model import quick_expert_init, qwen3_30b_a3b
from kt_sft.integrations.demo import write_tokenizer, yaml_text
from kt_sft.integrations.prepare import prepare

STEP = re.compile(r"kt_sft step \d+: (\d+) ms = CPU experts forward (\d+) \+ backward (\d+) \+ transfers (\d+) "
                  r"\+ GPU wait (\d+) \+ rest (-?\d+) .*?(?:GPU peak ([\d.]+) GiB allocated, ([\d.]+) reserved, )?"
                  r"host RSS ([\d.]+) GiB")
FIELDS = ("step", "forward", "backward", "transfers", "gpu wait", "rest", "GPU peak GiB", "GPU reserved GiB",
          "host RSS GiB")


def write_checkpoint(out: Path, layers: int, quick_init: bool) -> None:
    if (out / "config.json").exists():
        return
    vocab = write_tokenizer(out)
    config = qwen3_30b_a3b(layers)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 2, 0
    torch.manual_seed(0)
    with quick_expert_init() if quick_init else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert vocab <= config.vocab_size
    model.save_pretrained(out)


def write_data(out: Path, samples: int, seq: int) -> None:
    """Alpaca rows of random printable text, each longer than seq tokens (one token per character)."""
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))  # noqa: E731
    rows = [{"instruction": text(seq // 2), "input": "", "output": text(seq)} for _ in range(samples)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "long.json").write_text(json.dumps(rows))
    (out / "dataset_info.json").write_text(json.dumps({"kt_long": {"file_name": "long.json"}}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--work", default="/tmp/kt_lf_bench")
    ap.add_argument("--output-dir", help="where LLaMA-Factory saves the adapter (default: <work>/adapter)")
    ap.add_argument("--quick-init", action="store_true", help="write the checkpoint's experts and embeddings as "
                    "repeats of one random block (bench_model.py's --quick-init)")
    ap.add_argument("--no-checkpointing", action="store_true", help="LLaMA-Factory's "
                    "disable_gradient_checkpointing: no recompute, more GPU memory for activations")
    args = ap.parse_args()
    work = Path(args.work)
    model_dir, prepared, data = work / f"qwen3_30b_{args.layers}l", work / "prepared", work / "data"
    write_checkpoint(model_dir, args.layers, args.quick_init)
    prepare(model_dir, prepared)
    write_data(data, args.steps * args.grad_accum, args.seq)
    train = {
        "model_name_or_path": str(prepared), "trust_remote_code": True, "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0,
        "dataset": "kt_long", "dataset_dir": str(data), "template": "qwen", "cutoff_len": args.seq,
        "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": args.output_dir or str(work / "adapter"),
        "overwrite_output_dir": True, "logging_steps": 1, "save_strategy": "no", "plot_loss": False,
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": args.grad_accum,
        "learning_rate": 1e-4, "max_steps": args.steps, "bf16": torch.cuda.is_available(), "report_to": "none", "seed": 0,
        "disable_gradient_checkpointing": args.no_checkpointing,
    }
    (work / "train.yaml").write_text(yaml_text(train))
    env = dict(os.environ, KT_SFT_PROFILE="1")
    run = subprocess.run(["llamafactory-cli", "train", str(work / "train.yaml")], env=env, capture_output=True,
                         text=True)
    log = run.stdout + run.stderr
    (work / "train.log").write_text(log)
    lines = [m.groups() for m in STEP.finditer(log)]  # the progress bar shares their lines
    if run.returncode or len(lines) < 3:
        sys.exit(f"llamafactory-cli train failed (rc {run.returncode}, {len(lines)} step lines); its output is in "
                 f"{work / 'train.log'}")
    med = {k: statistics.median(float(v[i] or "nan") for v in lines[2:]) for i, k in enumerate(FIELDS)}
    # Step over engine time from sums over whole optimizer steps: with accumulation the clipping and optimizer
    # fall in one micro-batch of each step, which a median over micro-batches would leave out.
    whole = lines[2:][:len(lines[2:]) // args.grad_accum * args.grad_accum] or lines[2:]
    total = {k: sum(float(v[i] or "nan") for v in whole) for i, k in enumerate(FIELDS)}
    ratio = total["step"] / (total["forward"] + total["backward"])
    print(f"llamafactory-cli train: Qwen3-30B-A3B shape, {args.layers} of 48 layers, seq {args.seq}, LoRA r16 "
          f"(attention + every routed expert), grad accumulation {args.grad_accum}; medians of micro-batches "
          f"3..{len(lines)} (the profile's lines cover micro-batches 1..{len(lines)})"
          f"{'; no gradient checkpointing' if args.no_checkpointing else ''}")
    print(f"micro-batch {med['step']:.0f} ms, {args.seq / med['step'] * 1e3:.0f} tokens/s; GPU peak "
          f"{med['GPU peak GiB']:.2f} GiB allocated, {med['GPU reserved GiB']:.2f} reserved; host RSS "
          f"{med['host RSS GiB']:.1f} GiB")
    recompute = "" if args.no_checkpointing else " (incl. recompute)"
    print(f"CPU engine forward {med['forward']:.0f}{recompute} + backward {med['backward']:.0f} ms, "
          f"transfers {med['transfers']:.0f}, GPU wait {med['gpu wait']:.0f}, rest {med['rest']:.0f} ms; "
          f"step / CPU engine time {ratio:.2f} (sums over {len(whole)} micro-batches)")


if __name__ == "__main__":
    main()
