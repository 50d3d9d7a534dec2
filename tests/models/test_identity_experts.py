"""LongCat-Flash's zero-computation experts: router ids past the routed experts that return the token itself. The
engine computes the routed experts only; KTExperts adds the identity share. Tiny models against stock transformers,
and the checkpoint as published (no rows for those experts), which stock transformers 5.6 cannot load."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kt_sft.cli import run
from kt_sft.models import use_cpu_experts
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import save_checkpoint, tiny_model
from tolerances import FP32_IO, MERGED_BF16, rel_l2

IDS = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))


def routed_ids(model) -> torch.Tensor:
    """Every expert id the model's routers pick for IDS."""
    picked = []
    hooks = [m.register_forward_hook(lambda mod, args, out: picked.append(out[1].flatten()))
             for n, m in model.named_modules() if n.endswith("mlp.router")]
    with torch.no_grad():
        model(IDS)
    for h in hooks:
        h.remove()
    return torch.cat(picked)


def test_the_tiny_model_routes_to_both_kinds_and_matches_stock():
    stock = tiny_model("longcat_flash")
    ids = routed_ids(stock)
    assert (ids >= 6).any() and (ids < 6).any(), "the test routes to identity and routed experts both"
    kt = tiny_model("longcat_flash")
    assert use_cpu_experts(kt) == 2
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    assert all(m.num_experts == 6 and m.identity_experts == 2 for m in experts)
    with torch.no_grad():
        assert rel_l2(kt(IDS).logits, stock(IDS).logits) <= FP32_IO


@pytest.mark.parametrize("layout", ["stock_save", "published"])
def test_a_checkpoint_with_or_without_rows_for_the_identity_experts_loads(tmp_path, layout):
    # transformers saves gate and up rows for the zero-computation experts too (its class allots them, unread);
    # a published checkpoint holds the routed experts only, which stock transformers 5.6 refuses (size mismatch).
    stock = tiny_model("longcat_flash")
    src = tmp_path / "src"
    save_checkpoint(stock, src)
    if layout == "published":
        state = load_file(src / "model.safetensors")
        dropped = [k for k in state if ".experts.6." in k or ".experts.7." in k]
        assert dropped
        save_file({k: v for k, v in state.items() if k not in dropped}, str(src / "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            transformers.AutoModelForCausalLM.from_pretrained(src)
    assert run(["prepare", str(src), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, stock(IDS).logits) <= FP32_IO


def test_a_checkpoint_with_more_routed_experts_than_the_config_is_refused(tmp_path):
    src = tmp_path / "src"
    save_checkpoint(tiny_model("longcat_flash"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "n_routed_experts": 5, "zero_expert_num": 3}))
    with pytest.raises(ValueError, match=r"has model.layers.0.mlp.experts.5.down_proj.weight, an expert past the 5"):
        run(["prepare", str(src), str(tmp_path / "out")])


def test_a_stock_save_loads_strictly_into_the_cpu_experts(tmp_path):
    # What a full fine-tune's resume does with a save of the stock model: its gate/up rows for the zero-computation
    # experts have no place in the CPU experts, and are not unexpected keys.
    stock = tiny_model("longcat_flash")
    save_checkpoint(stock, tmp_path)
    kt = tiny_model("longcat_flash", seed=1)
    use_cpu_experts(kt)
    kt.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    with torch.no_grad():
        assert rel_l2(kt(IDS).logits, stock(IDS).logits) <= FP32_IO


def test_merged_and_unloaded_experts_keep_their_identity_experts():
    # PEFT's merge_and_unload puts new experts modules in place of the adapted ones.
    from test_peft_parity import kt_and_reference
    kt, _ = kt_and_reference("longcat_flash")
    with torch.no_grad():
        adapter = kt(IDS).logits
        merged = kt.merge_and_unload()
        assert all(m.identity_experts == 2 for m in merged.modules() if isinstance(m, KTExpertsLinear))
        assert rel_l2(merged(IDS).logits, adapter) <= MERGED_BF16


def test_the_stock_modules_fused_state_dict_loads_and_prepares(tmp_path):
    # The stock module's own state dict holds gate_up_proj with rows for the zero-computation experts too (E + Z):
    # a raw save of it, or a transformers that saves experts fused, writes that.
    stock = tiny_model("longcat_flash")
    state = stock.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    kt = tiny_model("longcat_flash", seed=1)
    use_cpu_experts(kt)
    kt.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert rel_l2(kt(IDS).logits, stock(IDS).logits) <= FP32_IO
    src = tmp_path / "src"
    save_checkpoint(stock, src)
    save_file({k: v.contiguous() for k, v in state.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert run(["prepare", str(src), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                                              dtype=torch.float32)
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, stock(IDS).logits) <= FP32_IO
