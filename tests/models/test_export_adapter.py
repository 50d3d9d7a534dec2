"""`kt-sft export`: a trained adapter's stacked expert LoRA rewritten per expert, loaded by stock PEFT into a module
tree with one module per expert projection (as transformers 4.x built MoE blocks, named as the checkpoint names
them), gives every expert's output as the CPU engine computes it with the stacked adapter."""
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from kt_sft.cli import run
from kt_sft.models import architecture_of, use_cpu_experts
from kt_sft.ops.reference import PROJECTIONS
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import save_checkpoint, tiny_model
from tolerances import FP32_IO, rel_l2


def trained_adapter(model_type, tmp_path):
    """The tiny model saved as a checkpoint, and an adapter on its routed experts (random A and B) saved beside it."""
    model = tiny_model(model_type)
    save_checkpoint(model, tmp_path / "model")
    use_cpu_experts(model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["experts", "o_proj"], init_lora_weights=False)
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
            for p in range(3):
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


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_adapter_loads_into_per_expert_modules_and_matches(model_type, tmp_path):
    peft_model, model_dir = trained_adapter(model_type, tmp_path)
    assert run(["export", str(tmp_path / "adapter"), str(tmp_path / "out"), "--model", str(model_dir)]) == 0
    arch = architecture_of(peft_model.config)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(["o_proj", *arch.checkpoint_projections])

    tree, layers = per_expert_tree(peft_model, arch)
    expert_config = LoraConfig.from_pretrained(str(tmp_path / "out"))
    expert_config.target_modules = set(arch.checkpoint_projections)  # the tree has no attention to take o_proj
    expert_config.task_type = None
    per_expert = get_peft_model(tree, expert_config)
    state = {k: v for k, v in load_file(str(tmp_path / "out" / "adapter_model.safetensors")).items()
             if "o_proj" not in k}
    result = set_peft_model_state_dict(per_expert, state)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]

    x = torch.randn(5, peft_model.config.hidden_size)
    for layer, experts in layers:
        for e in range(experts.num_experts):
            g, u, d = (per_expert.get_submodule(f"base_model.model.{arch.expert_module(layer, e, p)}")
                       for p in range(3))
            with torch.no_grad():
                want = d(torch.nn.functional.silu(g(x)) * u(x))
                got = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            assert rel_l2(got, want) <= FP32_IO, (layer, e)


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
