"""Shared experts queued while the CPU engine runs (kt_sft/models/overlap.py): installed on the blocks whose stock
forward applies them to the block's input after the routed experts, queued between the engine's start and its
wait in forward and in backward, and numerically the stock order. On the CPU the steps run in turn unless
`runs_beside` says otherwise (tests below make it run them concurrently); on a CUDA device (the GPU test
machine; skipped elsewhere, and said so) they run concurrently."""
import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kt_sft.models import use_cpu_experts
from kt_sft.models.overlap import installed_overlaps as overlaps
from kt_sft.ops import experts_function
from tiny_models import tiny_model
from tolerances import FP32_IO, GPU_VS_CPU, rel_l2

LORA = dict(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)


def lora_model(model_type, overlap=True):
    model = tiny_model(model_type)
    use_cpu_experts(model)
    shared = [o.shared for o in overlaps(model)]
    if not overlap:
        for o in overlaps(model):
            o.remove()
    torch.manual_seed(1)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(**LORA))
    # The shared experts' own weights train too, so that gradients flow through the reordered branch (LoRA on
    # them cannot be named here: peft >= 0.19 maps "*.down_proj" targets of these models to the fused experts).
    for m in shared:
        m.requires_grad_(True)
    return model


def loss_and_grads(model, checkpointing=None, device="cpu"):
    model = model.to(device).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # Not Llama 4's vision tower (its LoRA on o_proj), which a text batch leaves without grads.
    return loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                         if p.requires_grad and "vision_model." not in n}


@pytest.mark.parametrize("model_type,expected", [("deepseek_v3", 1), ("glm4_moe", 1), ("qwen2_moe", 0),
                                                 ("qwen3_moe", 0), ("granitemoeshared", 2), ("granitemoehybrid", 2),
                                                 ("granitemoe", 0), ("mistral4", 1), ("nemotron_h", 2),
                                                 ("mistral3", 1)])
def test_installed_where_the_block_calls_shared_experts_last(model_type, expected):
    # The tiny DeepSeek/GLM models have one dense layer then one MoE layer; Qwen2-MoE applies its shared expert
    # before routing (nothing to reorder), Qwen3-MoE has none. Granite's decoder layers call their shared MLP on the
    # block's input after the block (every layer of the tiny ones); Granite 3.0's have none.
    model = tiny_model(model_type)
    use_cpu_experts(model)
    assert len(overlaps(model)) == expected


class Recorded:
    """An engine whose calls log when they start and when their result is collected."""

    def __init__(self, engine, log):
        self.engine, self.log, self.now = engine, log, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def call(self, kind, *args, **kwargs):
        self.log.append(f"engine {kind}")
        self.now.append((kind, kwargs["now"]))
        pending, log = getattr(self.engine, kind)(*args, **kwargs), self.log

        class Logged:
            def wait(self):
                result = pending.wait()
                log.append(f"engine {kind} done")
                return result

        return Logged()

    def forward(self, *args, **kwargs):
        return self.call("forward", *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.call("backward", *args, **kwargs)


def recorded(model):
    """model's first MoE block's engine, replaced by a Recorded one whose log also has what runs beside it (its
    shared experts, or LongCat-Flash's dense MLP: forward, and the start of backward), overlapped or not."""
    if overlaps(model):
        experts, shared = overlaps(model)[0].experts, overlaps(model)[0].shared
    else:
        block = next(m for m in model.modules() if hasattr(m, "shared_experts"))
        experts, shared = block.experts, block.shared_experts
    log = []
    experts.engine = Recorded(experts.engine, log)

    def shared_ran(module, args, out):
        log.append("shared")
        if out.requires_grad:
            out.register_hook(lambda g: log.append("shared backward"))

    # On its last projection (down_proj, Granite's output_linear): a hook on the module itself keeps the stock order.
    [m for m in shared.modules() if isinstance(m, torch.nn.Linear)][-1].register_forward_hook(shared_ran)
    return experts.engine


# LongCat-Flash's: its dense MLP; Granite's: its shared MLP, both called by the decoder layer.
@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash", "granitemoeshared"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["in_turn", "concurrent"])
def test_shared_experts_run_once_while_the_engine_computes(concurrent, model_type, monkeypatch):
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: concurrent)
    model = lora_model(model_type)
    log = recorded(model).log
    loss_and_grads(model)
    # Between the engine's start and the wait for its result, in both passes: the shared experts' forward is
    # queued, and so is their backward (before the engine's gradients are waited for).
    assert log == ["engine forward", "shared", "engine forward done",
                   "engine backward", "shared backward", "engine backward done"]


def test_a_backward_that_adds_into_existing_grads_runs_the_engine_first(monkeypatch):
    # If a node between the engine's start and its result raised, a backward still running would go on changing
    # gradients the caller holds; only writes into the call's own buffers may run meanwhile.
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: True)
    model = lora_model("deepseek_v3")
    engine = recorded(model)
    loss_and_grads(model)  # the routed experts' LoRA grads are None: written into the module's buffers
    loss_and_grads(model)  # a second micro-batch: added into them
    assert [now for kind, now in engine.now if kind == "backward"] == [False, True]
    assert all(not now for kind, now in engine.now if kind == "forward")


def test_full_mode_runs_the_engine_first(monkeypatch):
    # The base weights' grads are added into param.grad: the same rule as a second micro-batch.
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: True)
    model = tiny_model("deepseek_v3")
    use_cpu_experts(model)
    engine = recorded(model)
    loss_and_grads(model)
    assert [now for kind, now in engine.now if kind == "backward"] == [True]


@pytest.mark.parametrize("where", ["module", "every_module"])
def test_hooks_on_the_shared_experts_run_once_in_the_stock_order(where):
    # Computed early through the module's call, and then called by the block, the shared experts had run their own
    # hooks twice: an output hook (here, doubling) applied twice.
    def twice(module, args, out):
        if module is block.shared_experts:
            calls.append(1)
            return out * 2

    results = []
    for overlap in (True, False):
        model, calls = lora_model("deepseek_v3", overlap=overlap), []
        block = next(m for m in model.modules() if hasattr(m, "shared_experts"))
        log = recorded(model).log
        hook = (block.shared_experts.register_forward_hook(twice) if where == "module" else
                torch.nn.modules.module.register_module_forward_hook(twice))
        try:
            results.append(loss_and_grads(model))
        finally:
            hook.remove()
        assert calls == [1]
        assert log[:3] == ["engine forward", "engine forward done", "shared"]
    (loss, grads), (loss_ref, grads_ref) = results
    assert loss == loss_ref and all(torch.equal(grads[n], g) for n, g in grads_ref.items())


def test_the_stock_order_runs_the_shared_experts_after_the_engine():
    model = lora_model("deepseek_v3", overlap=False)
    log = recorded(model).log
    loss_and_grads(model)
    assert log == ["engine forward", "engine forward done", "shared",
                   "shared backward", "engine backward", "engine backward done"]


@pytest.mark.parametrize("concurrent", [False, True], ids=["in_turn", "concurrent"])
@pytest.mark.parametrize("checkpointing", [None, True, False], ids=["plain", "reentrant_ckpt", "nonreentrant_ckpt"])
# Llama 4's shared expert beside its own block forward; LongCat-Flash's first dense MLP and Granite's shared MLP,
# which their decoder layers call on the MoE block's input after the block.
@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "glm4v_moe", "glm_moe_dsa", "hy_v3", "llama4",
                                        "longcat_flash", "granitemoeshared", "granitemoehybrid"])
def test_same_loss_and_gradients_as_the_stock_order(model_type, checkpointing, concurrent, monkeypatch):
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: concurrent)
    model = lora_model(model_type)
    installed = len(overlaps(model))
    loss, grads = loss_and_grads(model, checkpointing)
    assert installed and len(overlaps(model)) == installed  # none turned itself off
    loss_ref, grads_ref = loss_and_grads(lora_model(model_type, overlap=False), checkpointing)
    assert any(k in n for n in grads for k in ("shared_expert", "mlps.0", "shared_mlp")) and \
        any("experts.lora_A" in n for n in grads)
    assert loss == loss_ref  # the same operations on the same values, in another order
    # Autograd sums the two branches' gradients of the block input in another order: float32 rounding.
    for name, g in grads_ref.items():
        assert rel_l2(grads[name], g) <= FP32_IO, name


@pytest.mark.parametrize("concurrent", [False, True], ids=["in_turn", "concurrent"])
def test_same_loss_and_gradients_as_the_stock_order_in_nemotron_h(concurrent, monkeypatch):
    # Without checkpointing: transformers 5.6's Nemotron-H class does not support it.
    test_same_loss_and_gradients_as_the_stock_order("nemotron_h", None, concurrent, monkeypatch)


def test_generation_without_grad_matches_the_stock_order():
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    outs = [lora_model("deepseek_v3", overlap).eval().generate(input_ids=ids, max_new_tokens=4, do_sample=False)
            for overlap in (True, False)]
    assert torch.equal(*outs)


def test_a_block_that_calls_shared_experts_on_another_tensor_falls_back_with_a_warning():
    model = tiny_model("deepseek_v3")
    use_cpu_experts(model)
    (o,) = overlaps(model)
    block = next(m for m in model.modules() if getattr(m, "shared_experts", None) is o.shared)
    x = torch.randn(1, 3, 64)
    expected = o.run(x * 1.0)
    o.arm(block, (x,))
    block.experts.take_beside()()  # what the routed experts run while the engine computes
    with pytest.warns(RuntimeWarning, match="overlap with the CPU experts is turned off"):
        got = o.shared(x * 1.0)
    assert torch.equal(got, expected)
    assert not overlaps(model) and not block._forward_pre_hooks and not block._forward_hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("checkpointing", [None, False], ids=["plain", "nonreentrant_ckpt"])
@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash", "granitemoehybrid", "nemotron_h"])
def test_on_cuda_the_shared_experts_run_while_the_engine_computes(checkpointing, model_type):
    # The same kernels, the engine on its driver thread meanwhile; float32 CUDA kernels against the CPU engine.
    model = lora_model(model_type)
    log = recorded(model).log
    loss, grads = loss_and_grads(model, checkpointing, "cuda")
    assert log[:3] == ["engine forward", "shared", "engine forward done"]
    assert log[-3:] == ["engine backward", "shared backward", "engine backward done"]
    loss_ref, grads_ref = loss_and_grads(lora_model(model_type, overlap=False), checkpointing, "cuda")
    assert abs(loss - loss_ref) <= GPU_VS_CPU * abs(loss_ref)
    for name, g in grads_ref.items():
        assert rel_l2(grads[name], g) <= GPU_VS_CPU, name


def test_shared_experts_replaced_after_install_run_in_the_stock_order():
    # e.g. PEFT's modules_to_save wraps the module: the wrapper's own forward must be what the block uses.
    model = tiny_model("deepseek_v3")
    use_cpu_experts(model)
    block = next(m for m in model.modules() if hasattr(m, "shared_experts"))
    inner = block.shared_experts

    class Doubled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        block.shared_experts = Doubled()
        got = block(x)
        assert not overlaps(model) and not block._forward_pre_hooks and not block._forward_hooks
        block.shared_experts = inner
        assert torch.allclose(got - block(x), inner(x))


def test_a_no_grad_forward_on_another_thread_takes_nothing_of_a_training_forward(monkeypatch):
    # Thread A (an evaluation, generation) and thread B (training) through one block: A's routed experts had run
    # the shared experts that B's pre-hook queued, on B's input under A's no_grad, and B's block took that result:
    # the shared experts' grads were missing in B, and the layers below got a wrong dx. The order is forced here.
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: True)
    plain = loss_and_grads(lora_model("deepseek_v3"))[1]
    model = lora_model("deepseek_v3").train()
    block = next(m for m in model.modules() if hasattr(m, "shared_experts"))
    events = {name: threading.Event() for name in ("a_armed", "b_armed", "a_ran_experts", "b_done")}

    def before_block(module, args):
        if threading.current_thread().name == "A":
            events["a_armed"].set()
            events["b_armed"].wait(10)
        else:
            events["b_armed"].set()
            events["a_ran_experts"].wait(10)

    def after_experts(module, args, out):
        if threading.current_thread().name == "A":
            events["a_ran_experts"].set()
            events["b_done"].wait(10)

    block.register_forward_pre_hook(before_block)
    block.experts.register_forward_hook(after_experts)
    block.register_forward_hook(lambda *_: threading.current_thread().name == "B" and events["b_done"].set())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))

    def evaluate():
        with torch.no_grad():
            model(input_ids=other)

    def train():
        events["a_armed"].wait(10)
        model(input_ids=ids, labels=ids).loss.backward()

    threads = [threading.Thread(target=evaluate, name="A"), threading.Thread(target=train, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.is_set() for e in events.values())  # the order above happened
    for name, g in plain.items():
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and rel_l2(grad, g) <= FP32_IO, name


def test_shared_experts_called_on_the_flattened_block_input_keep_the_overlap(recwarn):
    # Hy3's block calls its shared experts on its input viewed as rows of tokens: the overlap had turned itself off
    # there, after computing them twice, and under non-reentrant checkpointing that first step's backward failed
    # (a different number of tensors saved by the recompute).
    model = tiny_model("hy_v3")
    use_cpu_experts(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(overlaps(model)) == 1
    assert not [w for w in recwarn if "overlap with the CPU experts is turned off" in str(w.message)]
