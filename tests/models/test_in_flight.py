"""Engine calls left in flight while Python queues the GPU work after them (kt_sft/ops/experts_function.py,
Running.ordered_on_stream): on a CUDA device the engine's results reach the GPU in its stream's order, and the
forward's saved state, a kept first pass and the backward's LoRA grads are waited for later. Here, on the CPU, the
stream's wait is played by waiting at once (there is no stream to hold), so what these tests check is the
bookkeeping around it: the same numbers, every call's time counted once, nothing running after a failed pass.
tests/models/test_gpu_hybrid.py and test_shared_overlap.py run it on CUDA, where the GPU test machine has one."""
import gc
import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kt_sft.models import use_cpu_experts
from kt_sft.ops import experts_function, timing
from tiny_models import tiny_model

LORA = dict(r=4, lora_alpha=8, target_modules=["o_proj", "experts"], init_lora_weights=False)


def lora_model(model_type="qwen3_moe"):
    model = tiny_model(model_type)
    use_cpu_experts(model)
    torch.manual_seed(1)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    return get_peft_model(model, LoraConfig(**LORA))


@pytest.fixture
def stream(monkeypatch):
    """Every call that would be left in flight on a GPU is, with the stream's wait played here; `ordered` lists
    the phases of the calls so ordered."""
    ordered = []
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: True)

    def ordered_on_stream(running, device):
        running.pending.wait()  # what the stream's host function waits for, before anything reads the result
        ordered.append(running.phase)
        return True

    monkeypatch.setattr(experts_function.Running, "ordered_on_stream", ordered_on_stream)
    return ordered


def micro_batches(model, n=2, checkpointing=None):
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()
    losses = []
    for b in range(n):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(b))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [None, True, False], ids=["plain", "reentrant_ckpt", "nonreentrant_ckpt"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_same_losses_and_gradients_as_waiting_at_once(model_type, checkpointing, stream, monkeypatch):
    # Two micro-batches: the second adds into the LoRA grads the first left (its backward is not left in flight).
    losses, grads = micro_batches(lora_model(model_type), 2, checkpointing)
    assert "forward" in stream and "backward" in stream
    monkeypatch.undo()
    ref_losses, ref_grads = micro_batches(lora_model(model_type), 2, checkpointing)
    assert losses == ref_losses
    assert any("experts.lora_A" in n for n in grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("checkpointing", [None, True], ids=["plain", "reentrant_ckpt"])
def test_every_call_is_counted_once(checkpointing, stream, monkeypatch):
    counted = []
    real = experts_function.add_engine_seconds
    monkeypatch.setattr(experts_function, "add_engine_seconds", lambda phase, s: counted.append(phase) or real(phase, s))
    micro_batches(lora_model(), 1, checkpointing)
    # Two MoE layers: one engine forward each (the reentrant recompute takes the kept first pass) and one backward.
    assert sorted(counted) == ["backward", "backward", "forward", "forward"]
    assert sorted(stream) == sorted(counted)
    assert timing.engine_seconds()["backward"] > 0


def test_a_failed_pass_leaves_no_engine_call_held(stream, monkeypatch):
    # A node after the backward's hand-over raises: the pass's callbacks are dropped, and with them the last
    # reference to the engine call, whose handle waits for it as it goes (bindings/module.cpp, Pending): nothing
    # goes on writing the grads the caller holds.
    model = lora_model()
    micro_batches(model, 1)
    handles = []
    real = experts_function.Running.__init__

    def track(running, pending, phase):
        real(running, pending, phase)
        handles.append(weakref.ref(running))

    monkeypatch.setattr(experts_function.Running, "__init__", track)

    def fail(module, args, out):
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a node failed")))

    model.base_model.model.model.layers[0].self_attn.o_proj.register_forward_hook(fail)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="a node failed"):
        loss.backward()
    assert len(handles) == 4  # the two layers' forwards and backwards
    backward_handles = handles[2:]
    assert all(h() is None for h in backward_handles)
    del loss
    gc.collect()
    assert all(h() is None for h in handles)


def test_a_kept_pass_in_flight_is_waited_for_when_dropped(stream):
    # A no-grad training-mode forward keeps its pass for a recompute; one that none takes is dropped by the next
    # forward, after its call is done, and merging an adapter waits for it before writing the weights.
    model = lora_model()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    experts = model.base_model.model.model.layers[0].mlp.experts
    with torch.no_grad():
        model.train()
        model(input_ids=ids)
        assert isinstance(experts.__dict__["_kept"].saved, experts_function.Running)
        model(input_ids=ids)
        assert "forward" in stream
        experts.merge_lora("default")
    assert "_kept" not in experts.__dict__
