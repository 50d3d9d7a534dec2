"""End to end through the stock `llamafactory-cli` (0.9.5, no forks, no use_kt): the demo checkpoint is
prepared, LoRA-trained (attention + every routed expert on the CPU engine), resumed from a checkpoint on
the same loss curve, chatted with, exported with the adapter merged (by LLaMA-Factory and by `kt-sft merge`),
fully fine-tuned, and trained on preferences (DPO, ORPO, SimPO, KTO) and as a reward model."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from kt_sft.integrations.demo import ANSWER, QUESTIONS, write_demo
from kt_sft.integrations.prepare import prepare
from tolerances import MERGED_BF16, TRAIN_STEPS, rel_l2

# The CLI of this interpreter's environment first (a venv need not be on PATH).
_HERE = Path(sys.executable).parent / "llamafactory-cli"
CLI = str(_HERE) if _HERE.exists() else shutil.which("llamafactory-cli")


# llamafactory-cli in this interpreter, counting the CPU engine's forwards (each starts at
# experts_function.start_forward): a checkpointed layer whose recompute found no kept first pass adds one.
COUNTING_CLI = """import atexit, sys
import kt_sft.ops.experts_function as f
count, start = [0], f.start_forward
def counted(*a, **k):
    count[0] += 1
    return start(*a, **k)
f.start_forward = counted
atexit.register(lambda: print(f"kt_sft engine forwards: {count[0]}"))
from llamafactory.cli import main
sys.argv[0] = "llamafactory-cli"
main()
"""


def run(args, cwd, stdin=None, env=None, count_engine_forwards=False):
    assert CLI, "llamafactory-cli is not installed; README's test command installs it"
    cli = [sys.executable, "-c", COUNTING_CLI] if count_engine_forwards else [CLI]
    p = subprocess.run([*cli, *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=1200,
                       env=None if env is None else {**os.environ, **env})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def write_yaml(path, base, **changes):
    cfg = yaml.safe_load(base.read_text())
    cfg.update(changes)
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(output_dir):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo(tmp_path_factory.mktemp("lf") / "demo")


@pytest.fixture(scope="module")
def lora_run(demo):
    out = demo / "run_a"
    log = run(["train", str(write_yaml(demo / "a.yaml", demo / "train.yaml", output_dir=str(out), save_steps=50))],
              demo, env={"KT_SFT_PROFILE": "25"})
    (out / "train.log").write_text(log)
    return out


def test_lora_loss_falls_and_adapter_holds_expert_lora(lora_run):
    curve = losses(lora_run)
    assert curve[max(curve)] < 0.1 * curve[min(curve)], curve
    with safe_open(str(lora_run / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.endswith("mlp.experts.lora_A.gate") for k in keys)
    assert any(k.endswith("self_attn.q_proj.lora_A.weight") for k in keys)


def test_step_profile_prints_under_llamafactory(lora_run):
    # LLaMA-Factory's progress bar shares the lines the profile prints on.
    steps = re.findall(r"kt_sft step (\d+): \d+ ms = CPU experts forward", (lora_run / "train.log").read_text())
    assert steps[:3] == ["25", "50", "75"], steps


def test_resume_continues_the_same_loss_curve(demo, lora_run):
    out = demo / "run_b"
    run(["train", str(write_yaml(demo / "b.yaml", demo / "train.yaml", output_dir=str(out),
                                 resume_from_checkpoint=str(lora_run / "checkpoint-50")))], demo)
    a, b = losses(lora_run), losses(out)
    resumed = [s for s in b if s > 50]
    assert resumed and min(resumed) > 50
    for s in resumed:
        assert abs(a[s] - b[s]) <= 1e-3 * max(a[s], 1e-3) + 1e-6, (s, a[s], b[s])


def test_training_without_gradient_checkpointing_gives_the_same_loss_curve(demo, lora_run):
    # disable_gradient_checkpointing (faster on the GPU test machine when its memory allows, BENCHMARKS.md): the
    # engine saves for backward in its one forward instead of keeping a pass for the recompute; same gradients.
    out = demo / "run_no_checkpointing"
    log = run(["train", str(write_yaml(demo / "no_ckpt.yaml", demo / "train.yaml", output_dir=str(out),
                                       disable_gradient_checkpointing=True))], demo)
    assert "Gradient checkpointing enabled" not in log
    assert "Gradient checkpointing enabled" in (lora_run / "train.log").read_text()
    assert losses(out) == losses(lora_run)


def test_chat_with_the_adapter_answers_from_the_data(demo, lora_run):
    chat = write_yaml(demo / "chat_a.yaml", demo / "chat.yaml", adapter_name_or_path=str(lora_run))
    out = run(["chat", str(chat)], demo, stdin="Who are you?\nexit\n")
    replies = [line for line in out.splitlines() if "Assistant:" in line]
    assert any(f"Assistant: {ANSWER}" in line for line in replies), replies


def test_export_merges_the_adapter_into_a_stock_checkpoint(demo, lora_run):
    export = write_yaml(demo / "export_a.yaml", demo / "chat.yaml", adapter_name_or_path=str(lora_run),
                        export_dir=str(demo / "merged"), export_device="cpu")
    run(["export", str(export)], demo)
    with safe_open(str(demo / "merged" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys, "merged weights keep the per-expert layout"
    assert not [k for k in keys if "lora" in k]
    ids = torch.tensor([[1, 5, 9, 14, 20, 31]])
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        demo / "prepared", trust_remote_code=True, dtype=torch.float32), lora_run)
    stock = AutoModelForCausalLM.from_pretrained(demo / "merged", dtype=torch.float32)  # no kt_sft code
    assert "KTExperts" not in type(stock.model.layers[0].mlp.experts).__name__
    with torch.no_grad():
        assert rel_l2(stock(ids).logits, adapter(ids).logits) <= MERGED_BF16


def test_kt_sft_merge_of_the_llamafactory_adapter_gives_its_logits(demo, lora_run):
    from kt_sft.cli import run
    assert run(["merge", str(demo / "prepared"), str(lora_run), str(demo / "kt_merged")]) == 0
    ids = torch.tensor([[1, 5, 9, 14, 20, 31]])
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        demo / "prepared", trust_remote_code=True, dtype=torch.float32), lora_run)
    stock = AutoModelForCausalLM.from_pretrained(demo / "kt_merged", dtype=torch.float32)  # no kt_sft code
    with torch.no_grad():
        assert rel_l2(stock(ids).logits, adapter(ids).logits) <= MERGED_BF16


@pytest.fixture(scope="module")
def full_run(demo):
    out = demo / "run_full"
    cfg = write_yaml(demo / "full.yaml", demo / "train.yaml", output_dir=str(out), finetuning_type="full",
                     learning_rate=1e-4, max_steps=20, save_steps=10)
    run(["train", str(cfg)], demo)
    return out, cfg


def expert_tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k}


def test_full_finetuning_trains_expert_weights(demo, full_run):
    out, _ = full_run
    curve = losses(out)
    assert curve[max(curve)] < curve[min(curve)], curve
    before, after = expert_tensors(demo / "model"), expert_tensors(out)
    key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert key in after, "the full checkpoint keeps the published per-expert layout"
    assert after[key].dtype == torch.float32, "LLaMA-Factory's upcast gave the experts a float32 master"
    assert not before[key].float().equal(after[key]), "expert weights were trained"


def test_full_finetuning_resumes_onto_the_same_experts(demo, full_run):
    # The Trainer's load_state_dict skips the per-expert keys a stock fused-experts model does not name: kt_sft's
    # load hook puts them back (into the float32 master), so a resumed run ends where the continuous one did.
    out, cfg = full_run
    resumed = demo / "run_full_resumed"
    run(["train", str(write_yaml(demo / "full_b.yaml", cfg, output_dir=str(resumed),
                                 resume_from_checkpoint=str(out / "checkpoint-10")))], demo)
    a, b = expert_tensors(out), expert_tensors(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def pref_data(demo):
    """Pairs for DPO/ORPO/SimPO/rm, and the same answers as KTO's unpaired desirable/undesirable examples."""
    data = demo / "pref_data"
    data.mkdir()
    rejected = "I am a large language model."
    (data / "pref.json").write_text(json.dumps(
        [{"instruction": q, "chosen": ANSWER, "rejected": rejected} for q in QUESTIONS]))
    (data / "kto.json").write_text(json.dumps(
        [{"instruction": q, "output": a, "kto_tag": a == ANSWER} for q in QUESTIONS for a in (ANSWER, rejected)]))
    (data / "dataset_info.json").write_text(json.dumps({
        "kt_pref": {"file_name": "pref.json", "ranking": True,
                    "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}},
        "kt_kto": {"file_name": "kto.json",
                   "columns": {"prompt": "instruction", "response": "output", "kto_tag": "kto_tag"}}}))
    return data


# Each step sees the whole data set (8 pairs; KTO's 16 examples), so the reference's mean log-probs are the same
# at every step. Engine forwards per step and MoE layer: the policy's (its checkpoint's recompute takes the kept
# first pass, README "Gradient checkpointing"), plus DPO's reference; KTO's KL pass (the policy, no grad) and the
# reference of both. A reference pass that dropped the kept passes would add the recompute's: one more.
STAGES = {
    "dpo": dict(stage="dpo", dataset="kt_pref", per_device_train_batch_size=8),
    "orpo": dict(stage="dpo", pref_loss="orpo", dataset="kt_pref", per_device_train_batch_size=8),
    "simpo": dict(stage="dpo", pref_loss="simpo", dataset="kt_pref", per_device_train_batch_size=8),
    "kto": dict(stage="kto", dataset="kt_kto", per_device_train_batch_size=16),
    "rm": dict(stage="rm", dataset="kt_pref", per_device_train_batch_size=8),
}
ENGINE_FORWARDS_PER_STEP = {"dpo": 2, "orpo": 1, "simpo": 1, "kto": 4, "rm": 1}
BETA = 0.1


def train_stage(demo, pref_data, name, stage, steps, **changes):
    """Trains `steps` steps of a STAGES entry on the demo (LoRA on attention and every routed expert unless
    changes say otherwise); returns the output directory, the logged steps and the engine's forward count."""
    out = demo / f"run_{name}"
    cfg = write_yaml(demo / f"{name}.yaml", demo / "train.yaml", output_dir=str(out), dataset_dir=str(pref_data),
                     pref_beta=BETA, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0,
                     max_steps=steps, logging_steps=1, **{**STAGES[stage], **changes})
    log = run(["train", str(cfg)], demo, count_engine_forwards=True)
    history = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert [h["step"] for h in history] == list(range(1, steps + 1)), history
    return out, history, int(re.findall(r"kt_sft engine forwards: (\d+)", log)[-1])


def assert_experts_lora_trained(out):
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        b = [f.get_tensor(k) for k in f.keys() if k.endswith("mlp.experts.lora_B.gate")]
    assert len(b) == 2 and all(t.abs().sum() > 0 for t in b), "the experts' LoRA trained"


def assert_reference_is_the_base_model(history):
    # rewards = beta·(policy − reference) log-probs: the reference (adapter disabled, experts' LoRA included) must
    # stay the model the first step saw, where the policy (every LoRA B at zero) was the reference.
    for side in ("chosen", "rejected"):
        reference = [h[f"logps/{side}"] - h[f"rewards/{side}"] / BETA for h in history]
        assert history[0][f"rewards/{side}"] == 0.0
        for r in reference:
            assert abs(r - reference[0]) <= 1e-5 * abs(reference[0]), (side, reference)


def test_dpo_with_lora_on_the_experts_starts_at_the_reference_and_learns(demo, pref_data):
    # TRL's DPO with a PEFT model takes the reference log-probs with the adapter disabled: with LoRA B at zero the
    # policy is exactly the reference at the first step (loss ln 2, rewards 0), and the experts' LoRA then trains.
    out, log, forwards = train_stage(demo, pref_data, "dpo", "dpo", steps=8)
    first, last = log[0], log[-1]
    assert abs(first["loss"] - 0.6931472) < 1e-5 and first["rewards/chosen"] == first["rewards/rejected"] == 0.0, first
    assert last["rewards/margins"] > 0 and last["loss"] < 0.5 * first["loss"], last
    assert_reference_is_the_base_model(log)
    assert forwards == 8 * 2 * ENGINE_FORWARDS_PER_STEP["dpo"]
    assert_experts_lora_trained(out)


@pytest.mark.parametrize("stage", ["orpo", "simpo", "kto", "rm"])
def test_preference_stage_with_lora_on_the_experts_learns(demo, pref_data, stage):
    steps = 4
    out, log, forwards = train_stage(demo, pref_data, stage, stage, steps)
    first, last = log[0], log[-1]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in log), log
    assert last["loss"] < 0.9 * first["loss"], (first, last)
    if stage != "rm":
        assert last["rewards/margins"] > first["rewards/margins"], (first, last)
    if stage == "kto":  # the policy (LoRA B at zero) is the reference at the first step: rewards and KL 0
        assert abs(first["loss"] - 0.5) < 1e-6 and first["kl"] < 1e-6, first
        assert_reference_is_the_base_model(log)
    if stage == "rm":
        with safe_open(str(out / "value_head.safetensors"), "pt") as f:
            assert "v_head.summary.weight" in f.keys()
    assert forwards == steps * 2 * ENGINE_FORWARDS_PER_STEP[stage]
    assert_experts_lora_trained(out)


@pytest.fixture(scope="module")
def bf16_experts_demo(demo):
    """The demo checkpoint with its expert weights rounded to BF16 (the values the engine holds), prepared: the
    stock model then computes on the engine's weights."""
    from safetensors.torch import load_file, save_file

    model = demo / "model_bf16_experts"
    shutil.copytree(demo / "model", model)
    weights = load_file(model / "model.safetensors")
    save_file({k: v.bfloat16().float() if ".mlp.experts." in k else v for k, v in weights.items()},
              model / "model.safetensors", metadata={"format": "pt"})
    prepare(model, demo / "prepared_bf16_experts")
    return model, demo / "prepared_bf16_experts"


@pytest.mark.parametrize("stage", ["kto", "rm"])
def test_preference_stage_follows_the_stock_model(demo, pref_data, bf16_experts_demo, stage):
    # LoRA on attention only (stock transformers 5 fuses the experts, which PEFT 0.18 cannot target): the kt_sft
    # model (experts frozen on the engine, whose kept first pass serves the recompute beside KTO's no-grad KL and
    # reference passes; rm's value head on top) against the unprepared checkpoint on stock transformers, step by step.
    # Measured: ≤ 1.3e-6 relative on every metric below; TRAIN_STEPS (1e-5) as for the engine's AdamW steps.
    stock, prepared = bf16_experts_demo
    runs = [train_stage(demo, pref_data, f"{stage}_{side}", stage, steps=4, lora_target="q_proj,v_proj",
                        model_name_or_path=str(path), trust_remote_code=side == "kt")
            for side, path in (("kt", prepared), ("stock", stock))]
    (_, kt, forwards), (_, ref, _) = runs
    assert forwards == 4 * 2 * ENGINE_FORWARDS_PER_STEP[stage]
    for a, b in zip(kt, ref):
        keys = {k for k in b if k in ("loss", "grad_norm", "kl") or k.startswith(("rewards/", "logps/"))}
        assert keys <= a.keys() and "loss" in keys, (a, b)
        for k in keys:
            assert abs(a[k] - b[k]) <= TRAIN_STEPS * max(abs(b[k]), 1e-2), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("example", sorted(p.name for p in (Path(__file__).parents[2] / "examples").glob("*.yaml")))
def test_example_configs_are_llamafactory_arguments(example):
    # What a user copies: every key an argument of LLaMA-Factory 0.9.5 (its parser refuses others), every template
    # one it ships. bf16 off: its check wants a GPU, which the configs are for.
    from llamafactory.data.template import TEMPLATES
    from llamafactory.hparams.parser import _parse_train_args

    args = yaml.safe_load((Path(__file__).parents[2] / "examples" / example).read_text())
    assert args["template"] in TEMPLATES
    _parse_train_args({**args, "bf16": False, "use_cpu": True})
