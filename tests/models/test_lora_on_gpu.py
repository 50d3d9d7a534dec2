"""KT_SFT_LORA_ON_GPU=1: the expert LoRA (and its grads, and so the optimizer's states) on the model's GPU, the
engine computing on CPU copies of it. Training, inference after optimizer steps, in-place edits, gradient
accumulation and the adapter's round trip must match the default (LoRA in CPU RAM) run. The CUDA tests need the
GPU test machine; without a CUDA device they are skipped and say so. On a CPU-only model the switch changes
nothing (checked here everywhere)."""

import collections

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch.optim import optimizer as optimizer_module  # an import: torch.optim does not keep it as an attribute

import kt_sft.nn.experts as kt_experts
from kt_sft.models import use_cpu_experts
from kt_sft.ops import gpu_lora
from kt_sft.peft.layer import KTExpertsLinear
from tiny_models import tiny_model
from tolerances import GPU_VS_CPU, TRAIN_STEPS, rel_l2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def lora_model(model_type="qwen3_moe", device=None):
    """A tiny model with LoRA on o_proj and the experts; device: moved there before get_peft_model (as the
    prepared model's loader does for LLaMA-Factory), else after it (by the caller)."""
    model = tiny_model(model_type)
    use_cpu_experts(model)
    if device is not None:
        model = model.to(device)
    torch.manual_seed(5)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "experts"],
                                            init_lora_weights=False))


def expert_lora(model):
    return [p for m in model.modules() if isinstance(m, KTExpertsLinear)
            for table in (m.lora_A, m.lora_B) for p in table["default"].values()]


def batch(seed, device):
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed)).to(device)


def train(model, device, steps=3, accumulation=2, fused=None):
    """AdamW steps with clipping, each over `accumulation` micro-batches; the losses of every micro-batch. The
    model is moved to device unless it is there (a move puts the expert LoRA where the switch says)."""
    if next(model.parameters()).device.type != device.type:
        model = model.to(device)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=fused)
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            ids = batch(10 * step + micro, device)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / accumulation).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm=0.5)
        opt.step()
        opt.zero_grad()
    return losses


def test_cpu_model_keeps_lora_on_cpu_with_the_switch_on(monkeypatch):
    on = lora_model()
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    on = on.to("cpu")
    monkeypatch.delenv("KT_SFT_LORA_ON_GPU")
    off = lora_model()
    assert all(p.device.type == "cpu" for p in expert_lora(on))
    assert train(on, torch.device("cpu"), steps=2) == train(off, torch.device("cpu"), steps=2)


def test_lora_that_cannot_fit_the_gpu_is_refused_with_the_fix(monkeypatch):
    # The check runs before anything moves, so a CPU-only machine can stand in for a full GPU.
    model = lora_model()
    experts = next(m for m in model.modules() if isinstance(m, KTExpertsLinear))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 10, 1 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(KTExpertsLinear, "lora_home", lambda self: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"KT_SFT_LORA_ON_GPU=1: the routed experts' LoRA \(\d+ values so far\) needs "
                                         r".* GiB are free there; unset KT_SFT_LORA_ON_GPU to keep it in host RAM"):
        experts.add_lora(64, 128, adapter="big")
    assert all(p.device.type == "cpu" for p in expert_lora(model))


@needs_cuda
@pytest.mark.parametrize("order", ["peft_then_to", "to_then_peft"])
def test_lora_follows_the_model_to_its_gpu_and_back(monkeypatch, order):
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    cuda = torch.device("cuda")
    model = lora_model() if order == "peft_then_to" else lora_model(device=cuda)
    model = model.to(cuda).to(torch.float32)  # a dtype-only move keeps it on the GPU
    experts = [m for m in model.modules() if isinstance(m, KTExpertsLinear)]
    assert experts and all(m.gate_up_proj.device.type == "cpu" for m in experts)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in expert_lora(model))
    model.cpu()
    assert all(p.device.type == "cpu" for p in expert_lora(model))
    assert all(not m._gpu_lora._copies and not m._gpu_lora._grads for m in experts)  # pinned buffers freed


def test_unloaded_experts_keep_the_models_device(monkeypatch):
    # LLaMA-Factory merges all but the last of several adapters (merge_and_unload), then puts the last on the model
    # where it is: the new LoRA goes where the model computes, as on experts that never held an adapter.
    model = lora_model()
    for m in model.modules():
        if isinstance(m, KTExpertsLinear):
            m._model_device = torch.device("cuda", 1)  # as a move of the model there leaves it (no device needed)
    unloaded = [m for m in model.merge_and_unload().modules() if isinstance(m, KTExpertsLinear)]
    assert unloaded and all(m._model_device == torch.device("cuda", 1) for m in unloaded)


@needs_cuda
def test_a_new_adapter_after_merge_and_unload_goes_to_the_gpu(monkeypatch):
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    merged = lora_model(device=torch.device("cuda")).merge_and_unload()
    torch.manual_seed(6)
    model = get_peft_model(merged, LoraConfig(r=4, lora_alpha=8, target_modules=["experts"]))
    assert expert_lora(model) and all(p.device.type == "cuda" for p in expert_lora(model))


@needs_cuda
def test_a_forward_under_inference_mode_before_training_leaves_usable_copies(monkeypatch):
    # The host copies were made by the first call: under inference_mode they were inference tensors, and the
    # optimizer step's prefetch into them raised (after the parameters had changed).
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    cuda = torch.device("cuda")
    model = lora_model().to(cuda)
    with torch.inference_mode():
        model(input_ids=batch(0, cuda))
    assert len(train(model, cuda, steps=2, accumulation=1)) == 2


@needs_cuda
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "nemotron_h"])  # Nemotron-H: no gate LoRA
def test_training_matches_lora_in_cpu_ram(monkeypatch, model_type):
    cuda = torch.device("cuda")
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "0")
    ref = lora_model(model_type)
    ref_losses = train(ref, cuda)
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(model_type)
    losses = train(gpu, cuda)
    assert all(p.device.type == "cuda" and p.grad is None for p in expert_lora(gpu))
    assert all(p.device.type == "cpu" for p in expert_lora(ref))
    # The same engine products on the same float32 LoRA values; what differs is AdamW on the GPU against the
    # CPU, and the clipping's norm summed there or on the engine's threads (last bits, then carried by Adam).
    assert losses == pytest.approx(ref_losses, rel=TRAIN_STEPS)
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert rel_l2(p.cpu(), q.cpu()) <= TRAIN_STEPS, name
    # Inference after the steps reads the updated values (the engine's copies taken again), and so does a
    # forward after an in-place edit that no optimizer made.
    ids = batch(99, cuda)
    gpu.eval(), ref.eval()
    for edit in (False, True):
        if edit:
            with torch.no_grad():
                for a, b in zip(expert_lora(gpu), expert_lora(ref)):
                    a.mul_(1.5), b.mul_(1.5)
        with torch.no_grad():
            assert rel_l2(gpu(input_ids=ids).logits.cpu(), ref(input_ids=ids).logits.cpu()) <= GPU_VS_CPU


@needs_cuda
def test_adapter_round_trip_with_lora_on_gpu(monkeypatch):
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    cuda = torch.device("cuda")
    trained = lora_model(device=cuda)
    train(trained, cuda, steps=1, accumulation=1)
    state = get_peft_model_state_dict(trained)
    fresh = lora_model(device=cuda)
    fresh.eval(), trained.eval()
    ids = batch(7, cuda)
    with torch.no_grad():
        before = fresh(input_ids=ids).logits  # its engine copies taken from its own LoRA first
    set_peft_model_state_dict(fresh, state)
    with torch.no_grad():
        after, want = fresh(input_ids=ids).logits, trained(input_ids=ids).logits
    assert not torch.equal(before, want)
    assert torch.equal(after, want)


@needs_cuda
def test_a_backward_that_raises_leaves_no_upload_behind(monkeypatch):
    # The grads' uploads wait for the next engine call; those of a backward that raised must not land in the grads
    # of a later one.
    cuda = torch.device("cuda")
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "0")
    ref = lora_model().to(cuda).train()
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(device=cuda).train()

    def stop(grad):
        raise RuntimeError("stopped on purpose")

    def stop_there(module, args, out):
        out.register_hook(stop)  # returns a handle, which a forward hook must not return

    # On the first layer's o_proj (LoRA: its output needs a grad, the frozen embeddings' does not), which backward
    # reaches after every layer's experts.
    o_proj = next(m for name, m in gpu.named_modules() if name.endswith("layers.0.self_attn.o_proj"))
    hook = o_proj.register_forward_hook(stop_there)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        gpu(input_ids=batch(1, cuda), labels=batch(1, cuda)).loss.backward()
    hook.remove()
    gpu.zero_grad()
    ids = batch(2, cuda)
    for model in (gpu, ref):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert rel_l2(p.grad.cpu(), q.grad.cpu()) <= GPU_VS_CPU, name


@needs_cuda
@pytest.mark.parametrize("reader", ["optimizer", "clipping"])
def test_what_reads_grads_after_a_backward_that_raised_waits_for_their_uploads(monkeypatch, reader):
    # A backward that raises runs no autograd callback, so the compute stream had not waited for the uploads it
    # made; a caller that goes on (skipping the batch) stepped on grads still being copied.
    cuda = torch.device("cuda", torch.cuda.current_device())  # as parameters name their device
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(device=cuda).train()

    def stop(grad):
        raise RuntimeError("stopped on purpose")

    o_proj = next(m for name, m in gpu.named_modules() if name.endswith("layers.0.self_attn.o_proj"))
    hook = o_proj.register_forward_hook(lambda module, args, out: out.register_hook(stop) and None)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        gpu(input_ids=batch(1, cuda), labels=batch(1, cuda)).loss.backward()
    hook.remove()
    assert cuda in gpu_lora._unwaited
    side = gpu_lora._queue_on_side(cuda)
    with torch.cuda.stream(side):  # an upload held up on the side stream: the reader must wait for it
        torch.cuda._sleep(2 * 10**9)
        gpu_lora._unwaited[cuda] = side.record_event()
    slow = gpu_lora._unwaited[cuda]
    params = [p for p in gpu.parameters() if p.grad is not None]
    if reader == "optimizer":
        torch.optim.SGD(params, lr=0.0).step()
    else:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.cuda.current_stream(cuda).record_event().synchronize()
    assert slow.query() and cuda not in gpu_lora._unwaited


@needs_cuda
def test_lora_a_load_put_on_the_gpu_trains_with_a_fused_optimizer(monkeypatch):
    # PEFT's low_cpu_mem_usage load assigns the loaded tensors, GPU ones included, whatever the switch says; a fused
    # AdamW then updates them without bumping their version counters, which the engine's copies must still see.
    cuda = torch.device("cuda")
    # As in a fresh process: no optimizer-step counter installed yet (the other tests here install it for good).
    monkeypatch.setattr(kt_experts, "_step_hook", [])
    monkeypatch.setattr(optimizer_module, "_global_optimizer_post_hooks", collections.OrderedDict())
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "0")
    ref = lora_model(device=cuda)
    gpu = lora_model(device=cuda)
    set_peft_model_state_dict(gpu, {k: v.to(cuda) for k, v in get_peft_model_state_dict(gpu).items()},
                              low_cpu_mem_usage=True)
    assert all(p.device.type == "cuda" for p in expert_lora(gpu))
    losses = train(gpu, cuda, fused=True)
    assert all(p.device.type == "cuda" for p in expert_lora(gpu))
    assert losses == pytest.approx(train(ref, cuda, fused=True), rel=TRAIN_STEPS)


@needs_cuda
def test_post_accumulate_grad_hooks_see_the_uploaded_grad(monkeypatch):
    # The engine's grads go up on a side stream, which the compute stream waits for at the backward's end; a
    # matrix with such a hook takes its grad through autograd, so the hook's reads follow its copy.
    cuda = torch.device("cuda")
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(device=cuda).train()
    a = expert_lora(gpu)[0]
    seen = []
    a.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    ids = batch(1, cuda)
    loss = gpu(input_ids=ids, labels=ids).loss
    with torch.cuda.stream(gpu_lora._queue_on_side(cuda)):
        torch.cuda._sleep(int(2e8))  # holds back whatever the side stream uploads next
    loss.backward()
    torch.cuda.synchronize()
    assert len(seen) == 1 and torch.equal(seen[0], a.grad)


@needs_cuda
def test_a_lora_copy_cut_short_by_an_error_is_made_again(monkeypatch):
    # The engine reads CPU copies of the GPU matrices, made again when they change; a copy an error stopped before
    # it was queued must not count as made.
    cuda = torch.device("cuda")
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "0")
    ref = lora_model(device=cuda).eval()
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(device=cuda).eval()
    ids = batch(1, cuda)
    with torch.no_grad():
        gpu(input_ids=ids)  # the copies made
        for model in (gpu, ref):
            for p in expert_lora(model):
                p.add_(0.5)
    queue = gpu_lora._queue_on_side

    def fail(device):
        raise torch.cuda.OutOfMemoryError("on purpose")

    monkeypatch.setattr(gpu_lora, "_queue_on_side", fail)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="on purpose"), torch.no_grad():
        gpu(input_ids=ids)
    monkeypatch.setattr(gpu_lora, "_queue_on_side", queue)
    with torch.no_grad():
        assert rel_l2(gpu(input_ids=ids).logits.cpu(), ref(input_ids=ids).logits.cpu()) <= GPU_VS_CPU


@needs_cuda
def test_two_threads_backward_through_the_gpu_lora_sum_their_grads(monkeypatch):
    # While one backward's grad of a matrix is on its way (a pinned buffer, then a side-stream upload), another
    # thread's backward writes its own buffer, which its hand-over adds in on the same stream: through autograd it
    # had been added on the compute stream, unordered with the first upload.
    import threading

    cuda = torch.device("cuda")
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    gpu = lora_model(device=cuda).train()
    params = expert_lora(gpu)
    alone = []
    for seed in (1, 2):
        gpu.zero_grad(set_to_none=True)
        ids = batch(seed, cuda)
        gpu(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        alone.append([p.grad.clone() for p in params])
    for _ in range(3):
        gpu.zero_grad(set_to_none=True)
        losses = [gpu(input_ids=batch(seed, cuda), labels=batch(seed, cuda)).loss for seed in (1, 2)]
        with torch.cuda.stream(gpu_lora._queue_on_side(cuda)):
            torch.cuda._sleep(int(2e8))  # holds back the first hand-over's upload past the second's grad
        barrier, errors = threading.Barrier(2), []

        def backward(loss):
            try:
                barrier.wait()
                loss.backward()
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=backward, args=(loss,)) for loss in losses]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        assert not errors
        for p, one, two in zip(params, *alone):
            assert rel_l2(p.grad, one + two) <= GPU_VS_CPU


@needs_cuda
def test_a_copy_another_call_queued_is_waited_for():
    # Inference from several threads: one call queued a changed matrix's copy and recorded it as taken; another,
    # finding nothing changed, handed the engine the buffer while the copy was still in flight.
    cuda = torch.device("cuda")
    lora = gpu_lora.GpuLora()
    p = torch.zeros(1 << 20, device=cuda)
    lora.engine_tensors([p], 0)
    p.add_(1)
    with torch.cuda.stream(gpu_lora._queue_on_side(cuda)):
        torch.cuda._sleep(int(2e8))  # holds back the copy queued next
    lora._copy_changed([p], 0)  # the other thread's call: queued, not waited for
    (copy,) = lora.engine_tensors([p], 0)
    assert torch.equal(copy, torch.ones(1 << 20))
