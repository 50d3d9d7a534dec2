"""kt-sft command line: `doctor` (what this machine can run), `prepare` (a model directory that
transformers / LLaMA-Factory load with the routed experts on the CPU engine), `export` (a trained adapter's
expert LoRA per expert, for other runtimes), `merge` (the published checkpoint with an adapter merged in, each
weight in its own format) and `demo` (a tiny local MoE checkpoint, dataset and LLaMA-Factory configs for the
quick start)."""
from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from . import _ext, capabilities
from .ops.host_memory import host_headroom


def installed(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def library_notes() -> list[str]:
    """The model-path libraries installed, and what their versions mean for training with kt_sft."""
    found = {name: installed(name) for name in ("transformers", "peft", "llamafactory")}
    lines = [", ".join(f"{name} {v or 'not installed'}" for name, v in found.items())]
    # The base install has no `packaging`: major and minor read by hand.
    peft = tuple(int(part) for part in re.findall(r"\d+", found["peft"] or "")[:2])
    if peft >= (0, 19):
        lines.append(f"peft {found['peft']} leaves a model's parameters as trainable as they were when get_peft_model "
                     "adds LoRA to kt_sft's experts: call model.requires_grad_(False) before it (LLaMA-Factory 0.9.5 "
                     "pins peft 0.18.1, which freezes them).")
    return lines


def doctor(_args) -> int:
    caps = capabilities()
    print(f"CPU features     : {', '.join(k for k, v in caps['cpu'].items() if v) or 'none of AVX2/AVX-512/AMX'}")
    print(f"kernel sets      : {', '.join(caps['runnable_kernels'])} (in use: {caps['kernels']})")
    print(f"tile products    : {caps['tiles']}")
    print(f"engine threads   : {caps['threads']} (pinned: {caps['pinned']})")
    if _ext.settings_error is not None:
        print(f"settings         : {_ext.settings_error} The experts refuse to run until it is fixed.")
    else:
        print("switches         : " + ", ".join(f"{k}={int(v)}" for k, v in _ext.switches().items()))
    room = host_headroom()
    print("memory           : " + (f"{room[1] / 2**30:.1f} GiB, {room[0] / 2**30:.1f} GiB of it available to this "
                                   "process (MemAvailable, or its cgroup's limit net of its use)" if room else "unknown"))
    if torch.cuda.is_available():  # free memory: what KT_SFT_LORA_ON_GPU's expert LoRA would be sized against
        free, total = torch.cuda.mem_get_info(0)
        print(f"GPU              : {torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB, "
              f"{free / 2**30:.1f} GiB free")
    else:
        print("GPU              : none")
    libraries, *notes = library_notes()
    print(f"libraries        : {libraries}")
    for note in notes:
        print(f"note             : {note}")
    if caps["kernels"] is None:
        print("This CPU cannot run the expert kernels (it needs AVX2 + FMA).")
        return 1
    return 0 if _ext.settings_error is None else 1


def demo(args) -> int:
    from .integrations.demo import write_demo

    root = write_demo(args.out_dir)
    print(f"wrote {root}: a tiny Qwen3-MoE checkpoint (model/), prepared for kt_sft (prepared/), an identity "
          f"dataset (data/) and LLaMA-Factory configs. Next:\n  cd {root} && llamafactory-cli train train.yaml && "
          "printf 'Who are you?\\nexit\\n' | llamafactory-cli chat chat.yaml")
    return 0


def prepare_cmd(args) -> int:
    from .integrations.prepare import prepare

    # Absolute: PEFT records the path a model was loaded from as the adapter's base, which export and merge read.
    out = prepare(args.model_dir, args.out_dir, threads=args.threads, kernels=args.kernels,
                  expert_format=args.expert_format).absolute()
    print(f"prepared {out}: load it with trust_remote_code (LLaMA-Factory: model_name_or_path: {out}, "
          "trust_remote_code: true)")
    return 0


def export_cmd(args) -> int:
    from .integrations.export import export_adapter

    out = export_adapter(args.adapter_dir, args.out_dir, model_dir=args.model)
    print(f"exported {out}: the adapter with its expert LoRA per expert (…experts.<e>.<projection>.lora_A/B.weight)")
    return 0


def merge_cmd(args) -> int:
    from .integrations.merge import merge_adapter

    start = time.monotonic()

    def progress(done, total, shard):
        left = (time.monotonic() - start) / done * (total - done)
        print(f"  shard {done}/{total} written ({shard}); about {left / 60:.0f} min left", file=sys.stderr, flush=True)

    report = merge_adapter(args.model_dir, args.adapter_dir, args.out_dir, progress=progress)
    print(f"merged {report.out_dir}: " + ", ".join(f"{n} {fmt} weights" for fmt, n in report.merged.items()))
    for fmt in report.merged:
        err = report.relative_error(fmt)
        advice = ("; most of the update is below the format's resolution: serve the adapter unmerged instead"
                  if err > 0.5 else "")
        print(f"  {fmt}: the merged weights carry the adapter's update with a relative L2 error of {err:.3g}{advice}")
    return 0


ADAPTER_HELP = "the saved adapter (training output_dir or a checkpoint)"


def run(argv=None) -> int:
    """The command line, raising what goes wrong (for callers and tests); `main` is the installed command."""
    ap = argparse.ArgumentParser(prog="kt-sft", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="report CPU features, kernel sets, threads, on/off switches, memory, GPU and "
                                  "library versions").set_defaults(fn=doctor)
    p = sub.add_parser("prepare", help="write a directory that LLaMA-Factory / transformers load with CPU experts")
    p.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors shards)")
    p.add_argument("out_dir", help="where to write the prepared directory (small: config, tokenizer files, links)")
    p.add_argument("--threads", type=int, help="engine threads (default: all CPUs the process may use)")
    p.add_argument("--kernels", help="force a kernel set (default: the best this CPU runs)")
    p.add_argument("--expert-format", choices=["bf16", "fp8", "int4"],
                   help="routed experts in RAM as BF16, FP8 block-128 or INT4 group-32 (default: the checkpoint's own "
                        "format; quantizing trades accuracy for RAM, and full fine-tuning needs bf16)")
    p.set_defaults(fn=prepare_cmd)
    x = sub.add_parser("export", help="rewrite a trained adapter's expert LoRA per expert, in the layout runtimes with "
                                      "per-expert modules read")
    x.add_argument("adapter_dir", help=ADAPTER_HELP)
    x.add_argument("out_dir", help="where to write the per-expert adapter")
    x.add_argument("--model", help="the model directory it was trained on (default: the adapter's base_model_name_or_path)")
    x.set_defaults(fn=export_cmd)
    g = sub.add_parser("merge", help="write the checkpoint with an adapter merged in, each weight in its published "
                                     "format (FP8 and INT4 quantized again)")
    g.add_argument("model_dir", help="the model the adapter was trained on (published checkpoint or prepared directory)")
    g.add_argument("adapter_dir", help=ADAPTER_HELP)
    g.add_argument("out_dir", help="a new directory for the merged checkpoint")
    g.set_defaults(fn=merge_cmd)
    d = sub.add_parser("demo", help="write a tiny MoE checkpoint, dataset and LLaMA-Factory configs (no downloads)")
    d.add_argument("out_dir")
    d.set_defaults(fn=demo)
    args = ap.parse_args(argv)
    return args.fn(args)


def main(argv=None) -> int:
    """`kt-sft`: errors from what the user gave (paths, files, settings) print their one sentence, without a
    traceback, and exit with status 2 (a damaged safetensors file among them: loader.checkpoint.open_safetensors
    names it); anything else keeps its traceback."""
    try:
        return run(argv)
    except (ValueError, OSError) as e:
        print(f"kt-sft: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("kt-sft: interrupted; an output directory it had begun writing is incomplete (merge and export remove "
              "their own, prepare completes it when run again): delete it and run the command again.", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
