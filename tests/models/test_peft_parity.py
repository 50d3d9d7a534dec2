"""Model level: stock transformers + PEFT with the experts swapped for the CPU engine, against the stock
model whose experts carry the same LoRA in plain PyTorch (kt_sft.ops.reference.ReferenceExperts)."""
import copy
import types
import warnings

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open

import kt_sft
from kt_sft.models import architecture_of, use_cpu_experts
from kt_sft.ops.reference import ReferenceExperts, moe_experts_reference
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import CONFIGS, tiny_model
from tolerances import FP32_IO, MERGED_BF16, TRAIN_STEPS, rel_l2

ARCHS = sorted(CONFIGS)
# Attention's output projection (LFM2-MoE's is out_proj, which Jamba's Mamba and LFM2's convolutions also have).
OUTPUT_PROJECTIONS = ["o_proj", "out_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=[*OUTPUT_PROJECTIONS, "experts"], init_lora_weights=False)


def output_projections(model_type):
    """OUTPUT_PROJECTIONS, but for Nemotron-H's Mamba out_proj, where peft >= 0.19 refuses LoRA (its CUDA kernels read
    the weight itself)."""
    return ["o_proj"] if model_type == "nemotron_h" else OUTPUT_PROJECTIONS


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    return dict(input_ids=ids, labels=ids)


def kt_and_reference(model_type, stock=None, outputs=None):
    """The tiny model_type (or `stock`) on the engine with LoRA on its output projections (or on `outputs`) and the
    experts, and the stock model with the same LoRA, its experts' in plain PyTorch."""
    stock = tiny_model(model_type) if stock is None else stock
    kt = copy.deepcopy(stock)
    use_cpu_experts(kt)
    architecture_of(stock.config).experts_in_place(stock)  # Granite's experts module, for ReferenceExperts to replace
    torch.manual_seed(1)
    for m in (kt, stock):  # peft >= 0.19 does not freeze a model that already holds tuner layers
        m.requires_grad_(False)
    outputs = output_projections(model_type) if outputs is None else outputs
    kt = get_peft_model(kt, LoraConfig(**{**LORA, "target_modules": [*outputs, "experts"]}))
    ref = get_peft_model(stock, LoraConfig(**{**LORA, "target_modules": outputs}))
    state = kt.state_dict()
    ref.load_state_dict({k: v for k, v in state.items() if any(f"{p}.lora_" in k for p in outputs)},
                        strict=False)
    block_forward = architecture_of(stock.config).block_forward
    for name, module in list(kt.named_modules()):
        if isinstance(module, KTExpertsLinear):
            A, B = module.lora_A["default"], module.lora_B["default"]
            new = ReferenceExperts(module.gate_up_proj.detach().float(), module.down_proj.detach().float(),
                                   {p: t.detach().clone() for p, t in A.items()},
                                   {p: t.detach().clone() for p, t in B.items()}, module.scaling["default"],
                                   module.identity_experts, *biases_of(module), module.unit)
            for frozen in (new.gate_up_proj, new.down_proj, new.gate_up_bias, new.down_bias):
                if frozen is not None:
                    frozen.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, new)
            if block_forward is not None:  # Llama 4's block, calling its experts as ours does
                ref.get_submodule(parent).forward = types.MethodType(block_forward, ref.get_submodule(parent))
    return kt, ref


def biases_of(experts):
    """An experts module's (gate_up_proj_bias, down_proj_bias) as float32 frozen copies (None where it has none)."""
    return [None if b is None else b.detach().float().clone() for b in (experts.gate_up_proj_bias,
                                                                       experts.down_proj_bias)]


def lora_tensors(model):
    """Every trainable LoRA tensor by a name common to both models."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name.replace(".default", "")] = p
    return out


@pytest.mark.parametrize("model_type", ARCHS)
def test_logits_match_stock_model(model_type):
    stock = tiny_model(model_type)
    kt = copy.deepcopy(stock)
    assert use_cpu_experts(kt) >= 1
    ids = batch(0)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("model_type", ARCHS)
def test_batched_generation_with_the_adapter_matches_the_reference(model_type):
    # What `llamafactory-cli chat` and generate() callbacks run: prompts of several lengths, left-padded, with the
    # KV cache (one token per step through the engine's decode) and without it.
    kt, ref = kt_and_reference(model_type)
    g = torch.Generator().manual_seed(2)
    lengths = (7, 3, 11)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, 96, (n,), generator=g)
        mask[row, -n:] = 1
    for use_cache in (True, False):
        out = [m.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                 use_cache=use_cache, output_logits=True, return_dict_in_generate=True)
               for m in (kt, ref)]
        assert torch.equal(out[0].sequences, out[1].sequences), use_cache
        assert rel_l2(torch.stack(out[0].logits), torch.stack(out[1].logits)) <= FP32_IO


def train_alike(kt, ref, batch_of):
    """Five AdamW steps of both models' LoRA on batch_of(step): the same losses and LoRA tensors after."""
    names = lora_tensors(kt)
    assert set(names) == set(lora_tensors(ref)), "both models train the same LoRA tensors"
    assert any("experts.lora_A" in n for n in names)
    # eps 1e-6, not 1e-8: Adam moves an element whose gradient is near eps by ~lr whatever its size, so a gradient
    # element at ~1e-8 (Granite 4.0-H's tiny model has some) turned float32's ~1e-9 absolute difference into an
    # update difference of ~5e-5; well above eps, updates are as with 1e-8.
    opts = [torch.optim.AdamW(lora_tensors(m).values(), lr=1e-3, eps=1e-6) for m in (kt, ref)]
    for step in range(5):
        losses = []
        for model, opt in zip((kt, ref), opts):
            opt.zero_grad()
            loss = model(**batch_of(step)).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= TRAIN_STEPS * abs(losses[1]), f"step {step}: {losses}"
    ref_t = lora_tensors(ref)
    for name, t in lora_tensors(kt).items():
        assert rel_l2(t, ref_t[name]) <= TRAIN_STEPS, name


@pytest.mark.parametrize("model_type", ARCHS)
def test_lora_training_steps_match_reference(model_type):
    train_alike(*kt_and_reference(model_type), batch)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])  # True: PEFT builds the adapter on meta, then loads it
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_adapter_saves_expert_lora_and_reloads(model_type, low_cpu_mem_usage, tmp_path):
    kt, _ = kt_and_reference(model_type)
    opt = torch.optim.AdamW([p for p in kt.parameters() if p.requires_grad], lr=1e-2)
    kt(**batch(0)).loss.backward()
    opt.step()
    kt.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.endswith("mlp.experts.lora_A.gate") for k in keys), keys
    assert all(".lora_A." in k or ".lora_B." in k for k in keys), keys
    fresh = tiny_model(model_type)
    use_cpu_experts(fresh)
    loaded = PeftModel.from_pretrained(fresh, tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, kt(ids).logits)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_expert_weights_stay_frozen_out_of_the_adapter_and_unchanged_by_loading_it(model_type, tmp_path):
    """peft 0.21 takes every tensor of a tuner layer outside its `base_layer` child for an adapter tensor: expert
    weights held on the layer itself would go into the adapter file (the whole expert stack) and be loaded over the
    weights of the model that the adapter is loaded into."""
    kt, _ = kt_and_reference(model_type)
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    assert not any(w.requires_grad for m in experts for w in (m.gate_up_proj, m.down_proj))
    assert all(".lora_" in n for n, p in kt.named_parameters() if p.requires_grad)
    assert all(".lora_A." in k or ".lora_B." in k for k in get_peft_model_state_dict(kt))
    kt.save_pretrained(tmp_path)
    other = tiny_model(model_type, seed=1)
    use_cpu_experts(other)
    experts = [m for m in other.modules() if isinstance(m, KTExpertsLinear)]
    weights = [(m.gate_up_proj.clone(), m.down_proj.clone()) for m in experts]
    PeftModel.from_pretrained(other, tmp_path)
    for m, (gate_up, down) in zip(experts, weights):
        assert torch.equal(m.gate_up_proj, gate_up) and torch.equal(m.down_proj, down)


@pytest.mark.parametrize("targets", ["all-linear", "lora_target: all"])
def test_mlp_projection_targets_reach_the_mlps_or_are_refused_by_name(targets):
    """DeepSeek-V3's dense and shared-expert MLPs have gate_proj/up_proj/down_proj modules, which "all-linear" and
    LLaMA-Factory's `lora_target: all` (every module whose class name contains "Linear") target besides 'experts'.
    peft 0.18.1 puts LoRA on all of them; newer peft (0.21) rewrites those names into target_parameters on the fused
    expert weights, which the experts refuse with the fix named instead of peft's own failure to wrap them."""
    model = tiny_model("deepseek_v3")
    use_cpu_experts(model)
    if targets == "lora_target: all":  # llamafactory.model.model_utils.misc.find_all_linear_modules
        targets = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                          if "Linear" in type(m).__name__ and n != "lm_head"})
        assert {"experts", "gate_proj", "o_proj"} <= set(targets)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    try:
        lora = get_peft_model(model.requires_grad_(False), config)
    except ValueError as e:
        assert config.target_parameters and "target the attention projections and 'experts'" in str(e)
        return
    trained = {n.partition(".lora_")[0] for n, p in lora.named_parameters() if p.requires_grad}
    for module in ("layers.0.mlp.gate_proj", "layers.1.mlp.shared_experts.down_proj", "layers.1.mlp.experts"):
        assert f"base_model.model.model.{module}" in trained, module


def merged_in_float64(module):
    """The experts' (gate_up, down) with the adapter's scaling·B·A added in float64, rounded once to BF16."""
    A, B, s, I = module.lora_A["default"], module.lora_B["default"], module.scaling["default"], module.intermediate_size
    gu, dn = module.gate_up_proj.detach().double(), module.down_proj.detach().double()
    gu[:, :I] += s * B["gate"].double() @ A["gate"].double()
    gu[:, I:] += s * B["up"].double() @ A["up"].double()
    dn += s * B["down"].double() @ A["down"].double()
    return gu.bfloat16(), dn.bfloat16()


def within_a_bf16_step(a, ref):
    """a rounds like ref up to one BF16 step: the float32 sum may cross a rounding boundary that float64's did not."""
    return torch.allclose(a.float(), ref.float(), rtol=2.0**-7, atol=0.0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_merged_adapter_matches_the_adapter(model_type):
    kt, _ = kt_and_reference(model_type)
    ids = batch(3)["input_ids"]
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    original = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in experts]
    expected = [merged_in_float64(m) for m in experts]
    with torch.no_grad():
        adapter = kt(ids).logits
        kt.merge_adapter()
        for m, (gu, dn) in zip(experts, expected):
            assert m.merged and within_a_bf16_step(m.gate_up_proj, gu) and within_a_bf16_step(m.down_proj, dn)
        merged = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in experts]
        assert rel_l2(kt(ids).logits, adapter) <= MERGED_BF16
        kt.unmerge_adapter()
        for m, before, after in zip(experts, original, merged):
            assert not m.merged
            for w, w0, w1 in zip((m.gate_up_proj, m.down_proj), before, after):
                # Two roundings away at most: half a BF16 step of the merged weight, half of the restored one.
                assert ((w.float() - w0.float()).abs() <= 2.0**-8 * (w1.float().abs() + w.float().abs())).all()
        plain = kt.merge_and_unload()
        assert not any(m.lora_A for m in plain.modules() if isinstance(m, KTExpertsLinear))
        assert not [k for k in plain.state_dict() if "lora" in k or "base_layer" in k]
        merged_logits = plain(ids).logits
        assert rel_l2(merged_logits, adapter) <= MERGED_BF16
    # Another adapter goes on the merged model's experts (LLaMA-Factory merges all but the last of several adapters,
    # then loads the last): a zero-initialized one leaves the merged logits as they are.
    again = get_peft_model(plain, LoraConfig(r=2, lora_alpha=4, target_modules=["experts"]))
    assert all(m.lora_A for m in again.modules() if isinstance(m, KTExpertsLinear))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, merged_logits)


def test_safe_merge_refuses_a_non_finite_adapter_and_leaves_the_weights():
    kt, _ = kt_and_reference("qwen3_moe")
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    before = experts[0].gate_up_proj.detach().clone()
    with torch.no_grad():
        experts[0].lora_B["default"]["up"][1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="would put NaN/Inf into expert 1's up weights"):
        experts[0].merge(safe_merge=True)
    assert torch.equal(experts[0].gate_up_proj, before) and not experts[0].merged


def kt_model(model_type="qwen3_moe"):
    model = tiny_model(model_type)
    use_cpu_experts(model)
    return model.requires_grad_(False)


def test_an_adapter_without_the_experts_merges_and_leaves_them_as_they_were():
    # The experts took every adapter name PEFT merges: an attention-only LoRA (a common recipe) raised in
    # merge_and_unload, half the model merged.
    ids = batch(3)["input_ids"]
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], init_lora_weights=False))
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    before = [m.gate_up_proj.detach().clone() for m in experts]
    with torch.no_grad():
        adapter = kt(ids).logits
        plain = kt.merge_and_unload()
        assert rel_l2(plain(ids).logits, adapter) <= FP32_IO
    assert all(torch.equal(m.gate_up_proj, w) for m, w in zip(experts, before))


def test_deleting_a_merged_adapter_is_refused_before_any_layer_changes():
    # peft 0.18.1 deleted it and left its update merged in the attention, while the experts took theirs out (before
    # that, its name stayed in the experts' merged_adapters and the next set_adapter raised).
    ids = batch(3)["input_ids"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "experts"], init_lora_weights=False)
    kt = get_peft_model(kt_model(), config, adapter_name="first")
    kt.add_adapter("second", copy.deepcopy(config))
    with torch.no_grad(), kt.disable_adapter():
        base = kt(ids).logits
    kt.merge_adapter()
    with torch.no_grad():
        merged = kt(ids).logits
    with pytest.raises(ValueError, match="'first' is merged into the weights.*call unmerge_adapter"):
        kt.delete_adapter("first")
    with torch.no_grad():
        assert torch.equal(kt(ids).logits, merged)
    kt.unmerge_adapter()
    kt.delete_adapter("first")
    assert all("first" not in m.lora_A for m in kt.modules() if isinstance(m, KTExpertsLinear))
    kt.set_adapter("second")
    with torch.no_grad(), kt.disable_adapter():
        assert rel_l2(kt(ids).logits, base) <= MERGED_BF16


def test_a_layer_deleting_a_merged_adapter_takes_its_update_out():
    # Called on the layer itself (LoraModel's refuses): its name had stayed in merged_adapters, and every later
    # unmerge raised.
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["experts"], init_lora_weights=False))
    experts = next(m for m in kt.modules() if isinstance(m, KTExpertsLinear))
    before = experts.gate_up_proj.detach().clone()
    experts.merge()
    experts.delete_adapter("default")
    assert not experts.merged_adapters and rel_l2(experts.gate_up_proj.float(), before.float()) <= MERGED_BF16


def two_adapters():
    """"xa" on the attention and the experts, "xc" on the attention only."""
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "experts"],
                                               init_lora_weights=False), adapter_name="xa")
    kt.add_adapter("xc", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    return kt.eval()


def logits_of(model, ids, adapter):
    if adapter == "__base__":
        with model.disable_adapter():
            return model(ids).logits
    model.set_adapter(adapter)
    return model(ids).logits


@pytest.mark.parametrize("rows", [["xc", "__base__", "xc"], ["xa", "xa", "xa"]])
@torch.no_grad()
def test_a_mixed_batch_that_gives_the_experts_one_adapter_matches_its_rows_run_alone(rows):
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(4))
    kt = two_adapters()
    mixed = kt(ids, adapter_names=rows).logits
    for i, adapter in enumerate(rows):
        assert rel_l2(mixed[i], logits_of(kt, ids[i:i + 1], adapter)[0]) <= FP32_IO


@torch.no_grad()
def test_a_mixed_batch_the_experts_cannot_serve_is_refused_and_leaves_the_model_usable():
    # The refusal came from inside the forward, after PEFT had registered its hooks, which it removes only when
    # the forward returns: every later call was refused too.
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(4))
    kt = two_adapters()
    kt.set_adapter("xc")
    before = kt(ids).logits
    for call in (lambda: kt(ids, adapter_names=["xa", "xc", "__base__"]),
                 lambda: kt.generate(input_ids=ids, adapter_names=["xa", "xc", "__base__"], max_new_tokens=2)):
        with pytest.raises(ValueError, match="give the routed experts different adapters"):
            call()
    assert torch.equal(kt(ids).logits, before)


@torch.no_grad()
def test_a_mixed_batch_naming_an_unknown_adapter_gets_peft_s_own_refusal():
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(4))
    kt = two_adapters()
    with pytest.raises(ValueError, match="non-existing adapter"):
        kt(ids, adapter_names=["xa", "typo", "xa"])


def test_merging_an_adapter_whose_expert_lora_is_not_finite_is_refused_before_any_layer_merges():
    # The engine's check of the merged weights refused it halfway through merge_and_unload, blaming the checkpoint.
    ids = batch(3)["input_ids"]
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "experts"],
                                               init_lora_weights=False))
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    with torch.no_grad():
        before = kt(ids).logits
        experts[-1].lora_B["default"]["gate"][1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="adapter 'default' holds NaN or Inf in its LoRA on the routed experts"):
        kt.merge_and_unload()
    with torch.no_grad():
        experts[-1].lora_B["default"]["gate"][1, 0, 0] = 0.0
        assert not any(m.merged for m in experts) and kt(ids).logits.isfinite().all()
        assert rel_l2(kt(ids).logits, before) <= 0.1  # only one LoRA entry changed


@torch.no_grad()
def test_a_mixed_batch_over_merged_experts_is_refused():
    # With the adapter on the experts alone (no PEFT layer to refuse it), its LoRA ran on top of its merged update.
    ids = batch(3)["input_ids"]
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["experts"], init_lora_weights=False))
    kt.eval().merge_adapter()
    with pytest.raises(ValueError, match="when there are merged adapters"):
        kt(ids, adapter_names=["default", "default"])


@pytest.mark.parametrize("merge", [True, False])
@torch.no_grad()
def test_a_mixed_peft_model_unloads_the_experts(merge):
    # PeftMixedModel put the experts' weight holder in their place: a KeyError halfway, and a model that no longer ran.
    ids = batch(3)["input_ids"]
    base = kt_model()
    plain = base(ids).logits
    mixed = peft.PeftMixedModel(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "experts"],
                                                 init_lora_weights=False))
    adapted = mixed(ids).logits
    out = (mixed.merge_and_unload() if merge else mixed.unload())(ids).logits
    assert rel_l2(out, adapted if merge else plain) <= (MERGED_BF16 if merge else FP32_IO)


def test_peft_features_the_experts_cannot_serve_are_named():
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["experts"]), adapter_name="x")
    kt.add_adapter("y", LoraConfig(r=4, lora_alpha=8, target_modules=["experts"]))
    for _ in range(2):  # PEFT had made the new adapter before the refusal, and a retry served it half made
        with pytest.raises(ValueError, match="add_weighted_adapter cannot combine adapters with LoRA on the routed"):
            kt.add_weighted_adapter(["x", "y"], [0.5, 0.5], "mix", combination_type="linear")
    assert "mix" not in kt.peft_config
    experts = next(m for m in kt.modules() if isinstance(m, KTExpertsLinear))
    assert "mix" not in experts.lora_A
    assert not hasattr(experts.lora_A["x"], "weight")  # hasattr (other libraries' probes) still answers


def test_peft_replaces_an_adapter_of_the_same_name_on_every_layer():
    # PEFT's add_adapter with a name the model holds overwrites it layer by layer; the experts' refusal (add_lora's,
    # for direct callers) had come after the attention's LoRA was replaced, and PEFT then dropped the config.
    kt = get_peft_model(kt_model(), LoraConfig(**LORA))
    experts = next(m for m in kt.modules() if isinstance(m, KTExpertsLinear))
    old = experts.lora_B["default"]["down"]
    try:
        kt.add_adapter("default", LoraConfig(**LORA))
    except ValueError as e:  # newer peft (checked: 0.21) refuses the name itself, before any layer changes
        assert "already exists" in str(e) and experts.lora_B["default"]["down"] is old
    else:
        assert list(kt.peft_config) == ["default"] and experts.lora_B["default"]["down"] is not old
    with pytest.raises(ValueError, match="already hold a LoRA adapter 'default'"):
        experts.add_lora(4, 8.0)


@pytest.mark.parametrize("method, config", [
    ("OFT", lambda targets: peft.OFTConfig(r=4, oft_block_size=0, target_modules=targets)),
    ("LOHA", lambda targets: peft.LoHaConfig(r=4, target_modules=targets)),
    ("IA3", lambda targets: peft.IA3Config(target_modules=targets, feedforward_modules=[])),
    ("ADALORA", lambda targets: peft.AdaLoraConfig(target_modules=targets, total_step=10)),
    ("VERA", lambda targets: peft.VeraConfig(r=4, target_modules=targets)),
])
def test_other_tuners_on_the_experts_are_refused_with_the_fix(method, config):
    # LLaMA-Factory's lora_target: all selects the experts for OFT too: PEFT's refusal had been a traceback (VeRA's
    # a RecursionError).
    with pytest.raises(ValueError, match=f"{method} cannot adapt the routed experts .* q_proj,k_proj,v_proj,o_proj"):
        get_peft_model(kt_model(), config(["q_proj", "experts"]))
    get_peft_model(kt_model(), config(["q_proj"]))


def test_experts_without_an_adapter_answer_bias_as_none():
    # PEFT probes `bias` on every LoRA layer under bias="lora_only": experts left out of the adapter had recursed.
    kt = get_peft_model(kt_model(), LoraConfig(**{**LORA, "layers_to_transform": [0], "bias": "lora_only"}))
    assert [m.bias for m in kt.modules() if isinstance(m, KTExpertsLinear)] == [None, None]


class LigerExperts(torch.nn.Module):
    """Stands for Liger Kernel's experts class (enable_liger_kernel puts it in place of the MoE experts): the stock
    layout and call, computed in PyTorch."""

    def __init__(self, stock):
        super().__init__()
        self.gate_up_proj, self.down_proj = stock.gate_up_proj, stock.down_proj

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return moe_experts_reference(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype),
                                     self.gate_up_proj, self.down_proj)


def test_experts_that_liger_kernel_swapped_in_go_to_the_engine():
    # They were not recognized: a prepared model's load blamed the checkpoint, an in-memory one found no experts.
    stock = tiny_model("qwen3_moe")
    for layer in stock.model.layers:
        layer.mlp.experts = LigerExperts(layer.mlp.experts)
    kt = copy.deepcopy(stock)
    assert use_cpu_experts(kt) == len(stock.model.layers)
    ids = batch(3)["input_ids"]
    with torch.no_grad():
        assert rel_l2(kt(ids).logits, stock(ids).logits) <= FP32_IO


@pytest.mark.parametrize("targets, warned", [(["q_proj", "gate_proj", "up_proj", "down_proj"], True),
                                            (["q_proj", "o_proj"], False), (["o_proj", "experts"], False)])
def test_per_expert_target_names_that_reach_no_expert_are_warned_about(targets, warned, recwarn):
    # transformers-4-era MoE recipes: the experts got no LoRA and stayed frozen without a word (peft 0.18.1, which
    # LLaMA-Factory 0.9.5 pins; newer peft rewrites those names into target_parameters and fails on them itself).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    try:
        kt = get_peft_model(kt_model(), config)
    except ValueError as e:  # peft >= 0.19, through _inject_parameters: the same sentence
        assert warned and config.target_parameters and "name the routed experts' fused weights" in str(e)
        return
    ids = batch(3)["input_ids"]
    for _ in range(2):  # one warning, at the first training forward
        kt(input_ids=ids, labels=ids).loss.backward()
    said = [w for w in recwarn if "name the routed experts' projections" in str(w.message)]
    assert len(said) == (1 if warned else 0), [str(w.message) for w in recwarn]


def test_warnings_reach_the_log_where_every_warning_is_ignored(caplog):
    # LLaMA-Factory's DPO and KTO trainers call warnings.simplefilter("ignore") for the whole process, which had
    # silenced kt_sft's warnings there (this one: experts left frozen).
    kt = get_peft_model(kt_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "w1"]))
    ids = batch(3)["input_ids"]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("ignore")
        kt(input_ids=ids, labels=ids).loss.backward()
    assert not shown
    said = [r.levelname for r in caplog.records if "name the routed experts' projections" in r.getMessage()]
    assert said == ["WARNING"]


def test_unsupported_model_type_is_a_clear_error():
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "gpt2"})()
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        use_cpu_experts(model)
    # Kimi-K2 built by its own remote code: named as supported in the refusal of it, before.
    model.config = type("Config", (), {"model_type": "kimi_k2"})()
    with pytest.raises(ValueError, match="this kimi_k2 model was built by its own remote code.*kt-sft prepare"):
        use_cpu_experts(model)
    model.config = type("Config", (), {"model_type": "kimi_k25"})()  # a composite of remote code: likewise
    with pytest.raises(ValueError, match="this kimi_k25 model was built by its own remote code.*as its text model"):
        use_cpu_experts(model)


def test_lora_dropout_reaches_the_experts():
    kt = tiny_model("qwen3_moe")
    use_cpu_experts(kt)
    kt = get_peft_model(kt.requires_grad_(False), LoraConfig(**{**LORA, "lora_dropout": 0.1}))
    experts = [m for m in kt.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all(m.lora_dropout["default"].p == 0.1 for m in experts)
    ids = batch(0)["input_ids"]
    with torch.no_grad():
        kt.train()
        assert not torch.equal(kt(ids).logits, kt(ids).logits)  # fresh masks each step
        kt.eval()
        assert torch.equal(kt(ids).logits, kt(ids).logits)
        # What TRL's disable_dropout_in_model (LLaMA-Factory's DPO and KTO trainers) does: it had left the experts'
        # LoRA dropout on, their rate kept apart from any nn.Dropout.
        for m in kt.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        kt.train()
        assert torch.equal(kt(ids).logits, kt(ids).logits)


def test_lora_on_trainable_expert_base_weights_is_refused():
    kt = tiny_model("qwen3_moe")
    use_cpu_experts(kt)
    kt = get_peft_model(kt, LoraConfig(**LORA))
    for m in kt.modules():  # as newer peft leaves them when the model was not frozen first
        if isinstance(m, KTExpertsLinear):
            m.gate_up_proj.requires_grad_(True)
    with pytest.raises(ValueError, match=r"call model.requires_grad_\(False\) before get_peft_model"):
        kt(**batch(0))


@pytest.mark.parametrize("kernels", ["amx", "avx512_bf16"])
def test_backward_copy_trains_the_same(kernels, monkeypatch):
    # A BF16 model through PEFT (the weights under base_layer), every expert's backward on tiles: LoRA training with
    # the backward copy takes bit-identical steps, and PEFT's merge (weights changed in place) repacks the copy.
    caps = kt_sft.capabilities()
    if kernels not in caps["runnable_kernels"]:
        pytest.skip(f"this CPU cannot run the {kernels} kernels ({caps['tiles']})")
    kt_sft.configure(kernels=kernels, tile_min_rows=1)
    try:
        runs = []
        for copy_on in ("0", "1"):
            monkeypatch.setenv("KT_SFT_BACKWARD_COPY", copy_on)
            model = tiny_model("qwen3_moe").to(torch.bfloat16)
            use_cpu_experts(model)
            model.requires_grad_(False)
            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(**LORA)).train()
            opt = torch.optim.AdamW(lora_tensors(model).values(), lr=1e-2)
            losses = []
            for step in range(3):
                opt.zero_grad()
                loss = model(**batch(step)).loss
                loss.backward()
                opt.step()
                losses.append(loss.item())
            # Merged and unmerged: the BF16 weights come back only to within a rounding, so a stale copy would show.
            model.merge_adapter()
            model.unmerge_adapter()
            opt.zero_grad()
            loss = model(**batch(3)).loss
            loss.backward()
            losses.append(loss.item())
            experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
            assert all(("_backward_copy" in m.__dict__) == (copy_on == "1") for m in experts)
            runs.append((losses, {n: t.grad.clone() for n, t in lora_tensors(model).items()}))
        assert runs[0][0] == runs[1][0]
        for name, t in runs[0][1].items():
            assert torch.equal(t, runs[1][1][name]), name
    finally:
        kt_sft.configure(kernels="", tile_min_rows=0)
