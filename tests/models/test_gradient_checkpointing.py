"""Gradient checkpointing (LLaMA-Factory's default) gives the same gradients as without it.

Policy (README "Gradient checkpointing"): a checkpointed layer reruns its forward in backward. Reentrant
checkpointing runs the first forward without grad: the engine keeps that pass, and the recompute takes it
(kt_sft/ops/kept_forward.py) unless KT_SFT_RECOMPUTE_EXPERTS=1; non-reentrant keeps the engine's saved g/u from
the first forward until backward, and its recompute stops before it would need the engine's result.
"""
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model

import kt_sft.ops.experts_function as function_module
from kt_sft.models import use_cpu_experts
from kt_sft import KTExperts
from kt_sft.ops.kept_forward import MISSES_BEFORE_OFF
from tiny_models import tiny_model
from tolerances import FP32_IO, rel_l2


def grads(gc_kwargs, dropout=0.0, engine_layers=None, device="cpu", model_type="qwen3_moe"):
    model = tiny_model(model_type)
    use_cpu_experts(model)
    if engine_layers is not None:
        engine_layers.append(sum(isinstance(m, KTExperts) for m in model.modules()))
    torch.manual_seed(3)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False, lora_dropout=dropout))
    model.train()
    torch.manual_seed(4)  # the dropout masks (the experts draw their seed from torch's RNG)
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    model.to(device)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    kept = [m for m in model.modules() if isinstance(m, KTExperts) and m.__dict__.get("_kept") is not None]
    assert not kept, "a kept first pass outlived its step"
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "lora_dropout"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_gives_same_gradients(use_reentrant, dropout):
    # With LoRA dropout the recomputed forward must drop what the first forward dropped: checkpointing restores
    # torch's RNG state, from which the experts draw their mask seed.
    plain = grads(None, dropout)
    ckpt = grads({"use_reentrant": use_reentrant}, dropout)
    assert any("experts.lora_A" in n for n in plain)
    for name, g in plain.items():
        assert rel_l2(ckpt[name].cpu(), g.cpu()) <= FP32_IO, name


def engine_forwards(monkeypatch) -> list:
    """A list that gets an entry at every engine forward from now on."""
    calls = []
    real = function_module.start_forward  # every engine forward starts there
    monkeypatch.setattr(function_module, "start_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_reentrant_checkpointing_runs_the_engine_forward_once_per_layer(recompute, device, monkeypatch):
    calls, layers = [], []
    real = function_module.start_forward  # every engine forward starts there
    monkeypatch.setattr(function_module, "start_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    if recompute:
        monkeypatch.setenv("KT_SFT_RECOMPUTE_EXPERTS", "1")
    plain = grads(None, 0.2, device=device)
    calls.clear()
    ckpt = grads({"use_reentrant": True}, 0.2, layers, device)
    assert len(calls) == layers[0] * (2 if recompute else 1)
    for name, g in plain.items():
        assert rel_l2(ckpt[name].cpu(), g.cpu()) <= FP32_IO, name


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])  # DeepSeek: shared experts beside the engine
def test_non_reentrant_checkpointing_runs_the_engine_forward_once_per_layer(model_type, device, monkeypatch):
    # Its recompute (what transformers' gradient_checkpointing_enable() does by default) had run every layer's
    # engine forward a second time, for a result nothing used.
    calls, layers = [], []
    real = function_module.start_forward
    monkeypatch.setattr(function_module, "start_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = grads(None, 0.2, device=device, model_type=model_type)
    calls.clear()
    ckpt = grads({"use_reentrant": False}, 0.2, layers, device, model_type)
    assert len(calls) == layers[0]
    for name, g in plain.items():
        assert rel_l2(ckpt[name].cpu(), g.cpu()) <= FP32_IO, name


@pytest.mark.parametrize("between", ["reference", "eval"])
@pytest.mark.parametrize("gc_kwargs", [None, {"use_reentrant": True}], ids=["no_checkpointing", "reentrant"])
def test_a_pass_without_grad_keeps_nothing_and_leaves_the_kept_passes(gc_kwargs, between, monkeypatch):
    # DPO's and KTO's reference pass (TRL, LLaMA-Factory: the policy with its adapter disabled, under no_grad in
    # training mode) between the policy's forward and its backward had dropped every layer's kept first pass and
    # kept its own, which no recompute takes: the recompute ran the engine again, after three steps every module
    # warned of a nondeterministic op and stopped keeping, and without checkpointing its passes sat in host RAM
    # through the backward. An evaluation or generation in eval mode there had dropped them too.
    calls = engine_forwards(monkeypatch)
    plain = grads(None)
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    experts = [m for m in model.modules() if isinstance(m, KTExperts)]
    torch.manual_seed(3)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False)).train()
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kt_sft")  # the "nondeterministic op" warning included
        for step in range(MISSES_BEFORE_OFF + 1):
            model.zero_grad()
            calls.clear()
            loss = model(input_ids=ids, labels=ids).loss
            if between == "reference":
                with torch.no_grad(), model.disable_adapter():
                    model(input_ids=ids)
            else:
                with torch.no_grad():
                    model.eval()(input_ids=ids)
                model.train()
            kept = sum(m.__dict__.get("_kept") is not None for m in experts)
            assert kept == (len(experts) if gc_kwargs else 0)
            loss.backward()
            assert len(calls) == 2 * len(experts)  # the policy's and the reference's; no recompute
    for name, g in plain.items():
        assert rel_l2(dict(model.named_parameters())[name].grad, g) <= FP32_IO, name


@pytest.mark.parametrize("gc_kwargs", [None, {"use_reentrant": True}, {"use_reentrant": False}],
                         ids=["no_checkpointing", "reentrant", "non_reentrant"])
def test_a_compiled_model_trains_as_the_uncompiled_one(gc_kwargs):
    # transformers' torch_compile (LLaMA-Factory's YAML passes it through): with checkpointing on, dynamo's tracing
    # of the checkpoint had failed on the layer call kt_sft hands it (a functools.partial has no __name__), and
    # without, it traced kt_sft's Python around the engine into ~20 graphs. The experts now run outside any graph.
    torch._dynamo.reset()
    plain = grads(gc_kwargs, dropout=0.2)
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    torch.manual_seed(3)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False, lora_dropout=0.2)).train()
    torch.manual_seed(4)
    if gc_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
        model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend="eager")(input_ids=ids, labels=ids).loss.backward()
    for name, g in plain.items():
        assert rel_l2(dict(model.named_parameters())[name].grad, g) <= FP32_IO, name


def test_a_forward_an_interrupt_ended_leaves_no_lasting_mark_on_what_is_kept():
    # torch runs forward hooks on Exception only: a KeyboardInterrupt inside a model's forward skips the one that
    # ends its "no recompute follows" mark. The model's next forward takes the stale mark off, where three
    # interrupted forwards had piled up three that turned keeping off for experts called on their own.
    from kt_sft.ops import kept_forward
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    experts = next(m for m in model.modules() if isinstance(m, KTExperts)).train()
    model.train()
    interrupt = experts.register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(input_ids=ids)
    interrupt.remove()
    assert len(kept_forward._model_calls.follows) == 1
    with torch.no_grad():
        model(input_ids=ids)
        assert not kept_forward._model_calls.follows
        experts(torch.randn(5, 64), torch.randint(0, 8, (5, 2)), torch.rand(5, 2))  # a checkpoint's first pass
    assert experts.__dict__.get("_kept") is not None


def test_a_checkpoint_of_the_callers_own_around_the_layers_keeps_the_first_pass(monkeypatch):
    # torch.utils.checkpoint applied by the caller (not through transformers' gradient_checkpointing_enable)
    # recomputes too: its first pass keeps, as under transformers' checkpointing.
    import functools
    from torch.utils.checkpoint import checkpoint
    calls = engine_forwards(monkeypatch)
    plain = grads(None)
    model = tiny_model("qwen3_moe")
    use_cpu_experts(model)
    torch.manual_seed(3)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                             init_lora_weights=False)).train()
    for layer in model.get_base_model().model.layers:
        own = layer.forward
        layer.forward = lambda x, *a, _own=own, **k: checkpoint(functools.partial(_own, *a, **k), x, use_reentrant=True)
    model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    calls.clear()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # a cache would hold the first pass's keys
    assert len(calls) == sum(isinstance(m, KTExperts) for m in model.modules())  # once per layer: kept
    for name, g in plain.items():
        assert rel_l2(dict(model.named_parameters())[name].grad, g) <= FP32_IO, name
