"""`kt-sft export`: a trained adapter's stacked expert LoRA rewritten per expert, loaded by stock PEFT into a module
tree with one module per expert projection (as transformers 4.x built MoE blocks, named as the checkpoint names
them), gives every expert's output as the CPU engine computes it with the stacked adapter."""
import errno
import json
import pathlib
import re

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from kt_sft.cli import main, run
from kt_sft.models import architecture_of, use_cpu_experts
from kt_sft.ops.reference import PROJECTIONS
from kt_sft.peft.layer import KTExpertsLinear
from quantized_checkpoints import kimi_k25_checkpoint
from tiny_models import qwen3_5_moe_published, save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2


def trained_adapter(model_type, tmp_path, targets=("experts", "o_proj")):
    """The tiny model saved as a checkpoint, and an adapter on its routed experts (random A and B) saved beside it."""
    model = tiny_model(model_type)
    save_checkpoint(model, tmp_path / "model")
    use_cpu_experts(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    peft_model = get_peft_model(model.requires_grad_(False), lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    return peft_model, tmp_path / "model"


def per_expert_tree(peft_model, arch):
    """A module tree holding each routed expert's projections as nn.Linear at the checkpoint's names, with the
    engine's weights; and (layer, module path prefix, KTExperts) for each MoE layer."""
    root, layers = nn.Module(), []
    for name, m in peft_model.named_modules():
        if not isinstance(m, KTExpertsLinear):
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        for e in range(m.num_experts):
            for p in arch.projections:
                w = m.projection_weight(PROJECTIONS[p], e).detach().float()
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data.copy_(w)
                parent = root
                *path, leaf = arch.expert_module(layer, e, p).split(".")
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.Module())
                    parent = getattr(parent, part)
                parent.add_module(leaf, linear)
        layers.append((layer, m))
    return root, layers


# Qwen3-VL-MoE's and Qwen3.5-MoE's under model.language_model, Llama 4's under language_model.model; Nemotron-H's
# experts have no gate.
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3_vl_moe", "qwen3_5_moe", "llama4", "nemotron_h",
                                        "internvl"])
def test_per_expert_adapter_loads_into_per_expert_modules_and_matches(model_type, tmp_path):
    peft_model, model_dir = trained_adapter(model_type, tmp_path)
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)]) == 0
    arch = architecture_of(peft_model.config)
    names = {arch.checkpoint_projections[p] for p in arch.projections}
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted({"o_proj", *names})

    tree, layers = per_expert_tree(peft_model, arch)
    expert_config = LoraConfig.from_pretrained(str(tmp_path / "out"))
    expert_config.target_modules = names  # the tree has no attention to take o_proj
    expert_config.task_type = None
    per_expert = get_peft_model(tree, expert_config)
    state = {k: v for k, v in load_file(str(tmp_path / "out" / "adapter_model.safetensors")).items()
             if "o_proj" not in k}
    result = set_peft_model_state_dict(per_expert, state)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    x = torch.randn(5, peft_model.config.get_text_config().hidden_size)
    for layer, experts in layers:
        for e in range(experts.num_experts):
            g, u, d = (per_expert.get_submodule(f"base_model.model.{arch.expert_module(layer, e, p)}")
                       if p in arch.projections else None for p in range(3))
            with torch.no_grad():
                want = d(torch.nn.functional.silu(g(x)) * u(x) if g is not None else torch.relu(u(x)) ** 2)
                got = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            assert rel_l2(got, want) <= FP32_IO, (layer, e)


def test_the_per_expert_adapter_loaded_into_a_kt_sft_model_is_warned_about(tmp_path, recwarn):
    # kt_sft's experts take the stacked adapter: the per-expert one attaches attention LoRA only, and its inference
    # had given logits ~100% off the trained adapter's without a word (the warning came at training forwards only).
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)]) == 0
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    try:
        loaded = PeftModel.from_pretrained(model, tmp_path / "out").eval()
    except ValueError as e:  # newer peft (checked: 0.21) rewrites per-expert targets to the fused weights: refused
        assert "kt-sft export's output" in str(e) and "load the stacked adapter" in str(e)
        return
    with torch.no_grad():
        for _ in range(2):
            loaded(input_ids=torch.arange(8)[None])
    said = [w for w in recwarn if "name the routed experts' projections" in str(w.message)]
    assert len(said) == 1 and "loads without its expert LoRA" in str(said[0].message)


def test_a_regular_expression_target_becomes_the_list_of_what_the_adapter_holds(tmp_path):
    # PEFT saves target_modules as a string when it was given a regular expression, which would match no per-expert
    # module; export had refused it without a way out.
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config,
                                                                          "target_modules": r".*\.(o_proj|experts)"}))
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)]) == 0
    exported = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert exported["target_modules"] == sorted(["o_proj", "gate_proj", "up_proj", "down_proj"])


def test_export_names_what_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        run(["export", str(tmp_path), str(tmp_path / "out")])
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    with pytest.raises(FileNotFoundError, match="pass the model directory with --model"):
        run(["export", str(tmp_path / "adapter"), str(tmp_path / "out")])
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 2 * config[
        "moe_intermediate_size"]}))
    with pytest.raises(ValueError, match="experts of intermediate size .*; export it with the model it was trained on"):
        run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)])


def test_an_adapter_without_expert_lora_is_named(tmp_path):
    model = tiny_model("qwen3_moe")
    save_checkpoint(model, tmp_path / "model")
    use_cpu_experts(model)
    get_peft_model(model.requires_grad_(False), LoraConfig(r=4, target_modules=["o_proj"])).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ValueError, match="holds no expert LoRA"):
        run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(tmp_path / "model")])


@pytest.mark.parametrize("failure, status, said", [
    (lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)), 2,
     r"kt-sft: the export to .*out failed \(No space left on device: .*adapter_config.json\) and its partial output"),
    (lambda path: KeyboardInterrupt(), 130, "kt-sft: interrupted;"),
], ids=["disk_full", "ctrl_c"])
def test_a_failed_export_leaves_nothing_and_runs_again(tmp_path, monkeypatch, capsys, failure, status, said):
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    args = ["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)]
    write_text = pathlib.Path.write_text

    def fail_on_config(path, *a, **k):  # the adapter's weights are written by then
        if path.name == "adapter_config.json":
            raise failure(path)
        return write_text(path, *a, **k)
    monkeypatch.setattr(pathlib.Path, "write_text", fail_on_config)
    capsys.readouterr()  # the model's save progress
    assert main(args) == status
    assert re.match(said, capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.exporting").exists()
    monkeypatch.undo()
    assert main(args) == 0 and (tmp_path / "out" / "adapter_config.json").exists()


def test_what_a_killed_export_left_is_kept(tmp_path):
    _, model_dir = trained_adapter("qwen3_moe", tmp_path)
    (tmp_path / ".out.exporting").mkdir()
    (tmp_path / ".out.exporting" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"\.out\.exporting exists \(left by an interrupted export\?\); delete"):
        run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)])
    assert (tmp_path / ".out.exporting" / "notes.txt").read_text() == "mine"


def test_a_composite_checkpoint_is_refused_through_its_prepared_directory(tmp_path):
    """Kimi-K2.5's text model sits under `language_model.`, served as its text model: the published checkpoint, its
    prepared directory (its text model's config.json) and the adapter's recorded base (that prepared directory) are
    all refused alike."""
    composite = "kimi_k25"
    save_checkpoint(tiny_model("deepseek_v3"), tmp_path / "bf16")
    src = kimi_k25_checkpoint(tmp_path / "bf16", tmp_path / "k25")
    prepared = tmp_path / "prepared"
    assert run(["prepare", str(src), str(prepared)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(prepared, trust_remote_code=True, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    get_peft_model(model.requires_grad_(False), lora).save_pretrained(tmp_path / "adapter")
    for model_args in (["--model", str(src)], ["--model", str(prepared)], []):
        with pytest.raises(ValueError, match=f"{composite} is a composite checkpoint; .* not supported for it"):
            run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), *model_args])
    assert not (tmp_path / "out").exists()


def test_an_adapter_of_qwen3_5_moes_text_model_prepared_by_an_earlier_kt_sft_exports_under_its_names(tmp_path):
    # Earlier kt_sft prepared Qwen3.5-MoE as its text model (config.json: text_config, model_type qwen3_5_moe_text):
    # the adapter trained there names model.layers.N, and its export had put the experts' LoRA under the whole
    # model's model.language_model.layers.N beside attention LoRA under the text model's names.
    qwen3_5_moe_published(tmp_path / "published")
    prepared = tmp_path / "prepared"
    assert run(["prepare", str(tmp_path / "published"), str(prepared)]) == 0
    config = json.loads((prepared / "config.json").read_text())
    (prepared / "config.json").write_text(json.dumps({**config["text_config"], "kt_sft": config["kt_sft"],
                                                      "auto_map": config["auto_map"]}))
    model = transformers.AutoModelForCausalLM.from_pretrained(prepared, trust_remote_code=True, dtype=torch.float32)
    assert model.config.model_type == "qwen3_5_moe_text"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)
    get_peft_model(model.requires_grad_(False), lora).save_pretrained(tmp_path / "adapter")
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out")]) == 0
    keys = list(load_file(str(tmp_path / "out" / "adapter_model.safetensors")))
    assert any(".mlp.experts.0.gate_proj.lora_A" in k for k in keys)
    assert all(k.startswith("base_model.model.model.layers.") for k in keys), keys[:3]


def test_targets_named_by_path_keep_only_the_modules_that_hold_lora(tmp_path):
    # LLaMA-Factory names an image-text model's targets by path (every module whose path contains a target name):
    # the export had kept the GLM-4.5V shared experts' activation and the LoRA layers' own children among them, which
    # stock PEFT refuses.
    model = tiny_model("glm4v_moe")
    save_checkpoint(model, tmp_path / "model")
    use_cpu_experts(model)
    peft_model = get_peft_model(model.requires_grad_(False), LoraConfig(r=4, target_modules=["q_proj", "o_proj",
                                                                                              "experts"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    names = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"]
    paths = [n.removeprefix("base_model.model.") for n, _ in peft_model.named_modules()
             if any(t in n for t in names) and "visual" not in n]
    assert any(t.endswith("act_fn") for t in paths) and any(t.endswith("lora_A") for t in paths)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": paths}))
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(tmp_path / "model")]) == 0
    exported = json.loads((tmp_path / "out" / "adapter_config.json").read_text())["target_modules"]
    assert {t.rsplit(".", 1)[-1] for t in exported} == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "model.language_model.layers.1.self_attn.q_proj" in exported
