"""Gradient checkpointing's recompute of layer L−1 run while the engine computes layer L's backward
(kt_sft/models/recompute_ahead.py): once per layer, in that place, and bit for bit the stock order's results.

On the CPU the engine's backward runs beside the caller only where `runs_beside` says so (tests below make it;
on a GPU it does), so these tests force it; the CUDA test runs where a GPU is (the GPU test machine)."""
import contextlib
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model

import kt_sft.models.recompute_ahead as recompute_ahead
from kt_sft import KTExperts
from kt_sft.models import use_cpu_experts
from kt_sft.ops import experts_function, timing
from tiny_models import COMMON, tiny_model
from tolerances import FP32_IO, rel_l2

LAYERS = 4


@pytest.fixture
def four_layers(monkeypatch):
    """Tiny models of LAYERS layers (DeepSeek-V3's first is dense), a log of each layer's engine backward and of
    each recompute ahead, and the engine's backward beside the caller as on a GPU."""
    monkeypatch.setitem(COMMON, "num_hidden_layers", LAYERS)
    monkeypatch.setattr(experts_function, "runs_beside", lambda device: True)
    log = []
    real = recompute_ahead.Pass.compute_ahead
    monkeypatch.setattr(recompute_ahead.Pass, "compute_ahead", lambda self: log.append("ahead") or real(self))
    return log


def logged(model, log):
    """Each engine's backward logs its start and its wait, with its layer's index."""
    for name, module in model.named_modules():
        if isinstance(module, KTExperts):
            layer = int(name.split("layers.")[1].split(".")[0])
            engine = module.engine

            class Logged:
                def __getattr__(self, attr, engine=engine):
                    return getattr(engine, attr)

                def backward(self, *args, engine=engine, layer=layer, **kwargs):
                    log.append(f"backward {layer}")
                    pending = engine.backward(*args, **kwargs)

                    class Waited:
                        def wait(self):
                            log.append(f"done {layer}")
                            return pending.wait()

                    return Waited()

            module.engine = Logged()


def lora_model(model_type, dropout=0.0, log=None):
    model = tiny_model(model_type)
    use_cpu_experts(model)
    if log is not None:
        logged(model, log)
    torch.manual_seed(3)
    model.requires_grad_(False)  # peft >= 0.19 does not freeze a model that already holds tuner layers
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "experts"],
                                             init_lora_weights=False, lora_dropout=dropout))
    return model.train()


def enable_checkpointing(model, use_reentrant=True, **kwargs):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant, **kwargs})
    model.enable_input_require_grads()


def train(model, steps=2, device="cpu", autocast=None):
    """Losses and the last step's grads of `steps` SGD steps (the weights change between them, so each step's
    first passes are new)."""
    model.to(device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(4)  # the dropout masks (the experts draw their seed from torch's RNG)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(**autocast) if autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
    return losses, grads


def stock(model_type, monkeypatch, checkpointing=None, **kwargs):
    monkeypatch.setenv("KT_SFT_RECOMPUTE_AHEAD", "0")
    model = lora_model(model_type, kwargs.pop("dropout", 0.0))
    enable_checkpointing(model, **(checkpointing or {}))
    result = train(model, **kwargs)
    monkeypatch.delenv("KT_SFT_RECOMPUTE_AHEAD")
    return result


def assert_same(result, expected, exact=True):
    """The same operations on the same values, in another order: bit for bit on the CPU; within FP32_IO where GPU
    kernels may sum in an order of their own from run to run (attention's backward)."""
    (losses, grads), (losses_ref, grads_ref) = result, expected
    assert losses == losses_ref if exact else losses == pytest.approx(losses_ref, rel=FP32_IO)
    assert grads.keys() == grads_ref.keys() and any("experts.lora_A" in n for n in grads)
    for name, g in grads_ref.items():
        assert torch.equal(grads[name], g) if exact else rel_l2(grads[name], g) <= FP32_IO, name


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "lora_dropout"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_each_layer_is_recomputed_while_the_engine_computes_the_next_ones_backward(model_type, dropout, four_layers,
                                                                                  monkeypatch):
    # LoRA dropout on attention and experts: the recompute ahead must draw the first forward's masks.
    log = four_layers
    expected = stock(model_type, monkeypatch, dropout=dropout)
    assert log == []  # KT_SFT_RECOMPUTE_AHEAD=0
    model = lora_model(model_type, dropout, log)
    enable_checkpointing(model)
    assert_same(train(model), expected)
    first_moe = 1 if model_type == "deepseek_v3" else 0  # its layer 0 is dense: recomputed ahead by layer 1
    step = [entry for layer in range(LAYERS - 1, first_moe - 1, -1)
            for entry in (f"backward {layer}", *(["ahead"] if layer > 0 else []), f"done {layer}")]
    assert log == step + step


def test_a_forward_without_backward_leaves_nothing_ahead(four_layers, monkeypatch):
    # A training-mode forward without grad (a logging pass) notes first passes that no backward follows; the next
    # forward starts a chain of its own.
    expected = stock("qwen3_moe", monkeypatch, steps=1)
    model = lora_model("qwen3_moe")
    enable_checkpointing(model)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1)))
    assert_same(train(model, steps=1), expected)
    assert four_layers.count("ahead") == LAYERS - 1


def test_inference_mode_forwards_in_training_mode_leave_the_next_step_as_it_was(four_layers, monkeypatch):
    # A generate under inference_mode between training steps, the model left in training mode: its tensors keep no
    # version counter, and nothing recomputes them (it had raised noting them as a first forward).
    expected = stock("qwen3_moe", monkeypatch, steps=1)
    model = lora_model("qwen3_moe")
    enable_checkpointing(model)
    with torch.inference_mode():
        model.generate(input_ids=torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1)),
                       max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert_same(train(model, steps=1), expected)


def test_a_backward_that_adds_into_existing_grads_keeps_the_stock_order(four_layers, monkeypatch):
    # A second micro-batch adds the expert LoRA grads into param.grad: the engine runs first, nothing beside it.
    model = lora_model("qwen3_moe")
    enable_checkpointing(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert four_layers.count("ahead") == LAYERS - 1
    model(input_ids=ids, labels=ids).loss.backward()
    assert four_layers.count("ahead") == LAYERS - 1


def test_non_reentrant_checkpointing_runs_as_before(four_layers, monkeypatch):
    monkeypatch.setenv("KT_SFT_RECOMPUTE_AHEAD", "0")
    reference = lora_model("qwen3_moe")
    enable_checkpointing(reference, use_reentrant=False)
    expected = train(reference)
    monkeypatch.delenv("KT_SFT_RECOMPUTE_AHEAD")
    model = lora_model("qwen3_moe")
    enable_checkpointing(model, use_reentrant=False)
    assert_same(train(model), expected)
    assert "ahead" not in four_layers


def test_under_autocast_the_recompute_ahead_casts_as_the_first_forward(four_layers, monkeypatch):
    # The checkpoint restores the first forward's autocast for its recompute; so must the work ahead (without it,
    # attention would run in float32 there and the gradients would differ).
    bf16 = dict(device_type="cpu", dtype=torch.bfloat16)
    expected = stock("qwen3_moe", monkeypatch, autocast=bf16)
    model = lora_model("qwen3_moe")
    enable_checkpointing(model)
    assert_same(train(model, autocast=bf16), expected)
    assert four_layers.count("ahead") == 2 * (LAYERS - 1)


def test_through_llamafactorys_checkpoint_wrapper(four_layers, monkeypatch):
    # LLaMA-Factory's wrapper finds the layer through the function's __self__: the stand-in is bound to it.
    from llamafactory.model.model_utils.checkpointing import _gradient_checkpointing_enable

    expected = stock("qwen3_moe", monkeypatch)
    model = lora_model("qwen3_moe")
    base = model.get_base_model()
    _gradient_checkpointing_enable(base, {"use_reentrant": True})
    model.enable_input_require_grads()
    assert_same(train(model), expected)
    assert four_layers.count("ahead") == 2 * (LAYERS - 1)


@pytest.mark.parametrize("enabled_by", ["transformers", "llamafactory"])
def test_a_checkpoint_that_does_not_restore_the_rng_keeps_the_stock_order(enabled_by, four_layers, monkeypatch):
    # preserve_rng_state=False: the checkpoint's recompute draws new dropout masks, which the work ahead (restoring
    # the first forward's RNG) would not; bound in transformers' partial of torch's checkpoint, and found under
    # LLaMA-Factory's wrapper of that partial.
    from llamafactory.model.model_utils.checkpointing import _gradient_checkpointing_enable

    no_restore = {"preserve_rng_state": False}
    expected = stock("qwen3_moe", monkeypatch, checkpointing=no_restore, dropout=0.2)
    rng = torch.get_rng_state()
    model = lora_model("qwen3_moe", 0.2)
    if enabled_by == "llamafactory":
        _gradient_checkpointing_enable(model.get_base_model(), {"use_reentrant": True, **no_restore})
        model.enable_input_require_grads()
    else:
        enable_checkpointing(model, **no_restore)
    assert_same(train(model), expected)
    assert torch.equal(torch.get_rng_state(), rng)
    assert "ahead" not in four_layers


def failing_ahead(monkeypatch, error):
    """The computation ahead raises error once it restored the RNG (where the layer's forward would run)."""

    @contextlib.contextmanager
    def raising(_state):
        raise error
        yield

    monkeypatch.setattr(recompute_ahead, "_autocast", raising)


def test_out_of_gpu_memory_ahead_leaves_the_recompute_to_the_checkpoint(four_layers, monkeypatch):
    # The work ahead holds one more layer's activations than the stock order: out of memory there, the step goes
    # on in the stock order, with a warning, and no later layer tries again.
    monkeypatch.setattr(recompute_ahead, "_out_of_memory", False)  # restored after the test
    expected = stock("qwen3_moe", monkeypatch, dropout=0.2)
    failing_ahead(monkeypatch, torch.cuda.OutOfMemoryError("CUDA out of memory (a test)"))
    model = lora_model("qwen3_moe", 0.2)
    enable_checkpointing(model)
    with pytest.warns(RuntimeWarning, match="ran out of memory recomputing"):
        result = train(model)
    assert_same(result, expected)
    assert four_layers.count("ahead") == 1


def test_an_error_ahead_reaches_the_caller_after_the_engine_is_done(four_layers, monkeypatch):
    # No engine call is left running behind the error: the next step trains as the stock order would.
    expected = stock("qwen3_moe", monkeypatch, steps=1)
    model = lora_model("qwen3_moe", log=four_layers)
    enable_checkpointing(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as failing:
        failing_ahead(failing, RuntimeError("raised ahead (a test)"))
        with pytest.raises(RuntimeError, match="raised ahead"):
            model(input_ids=ids, labels=ids).loss.backward()
    assert four_layers == [f"backward {LAYERS - 1}", "ahead", f"done {LAYERS - 1}"]
    model.zero_grad(set_to_none=True)
    assert_same(train(model, steps=1), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_on_cuda_the_recompute_runs_while_the_engine_computes(monkeypatch):
    # No forcing: on a GPU the engine's backward runs beside the caller by itself.
    log = []
    real = recompute_ahead.Pass.compute_ahead
    monkeypatch.setattr(recompute_ahead.Pass, "compute_ahead", lambda self: log.append("ahead") or real(self))
    expected = stock("qwen3_moe", monkeypatch, dropout=0.2, device="cuda")
    model = lora_model("qwen3_moe", 0.2, log)
    enable_checkpointing(model)
    assert_same(train(model, device="cuda"), expected, exact=False)
    assert log == [entry for layer in (1, 0) for entry in
                   (f"backward {layer}", *(["ahead"] if layer else []), f"done {layer}")] * 2


def test_the_work_ahead_adds_no_time_to_the_step_profile(four_layers, monkeypatch):
    # It runs within the span of the engine's backward, which that call's wait counts whole: a transfer or GPU
    # wait timed inside it (the layer's input copied to the engine, on a GPU) would count twice.
    real = recompute_ahead.Pass.compute_ahead

    def slow(self):
        with timing.engine_timer("transfer"):
            time.sleep(0.05)
        return real(self)

    monkeypatch.setattr(recompute_ahead.Pass, "compute_ahead", slow)
    model = lora_model("qwen3_moe")
    enable_checkpointing(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    timing.reset_engine_seconds()
    t0 = time.perf_counter()
    loss.backward()
    wall = time.perf_counter() - t0
    assert timing.engine_seconds()["transfer"] < 0.05
    assert timing.engine_seconds()["backward"] >= 0.05 * (LAYERS - 1)  # the engine's spans hold the work
    assert sum(timing.engine_seconds().values()) <= wall


class CopyingCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint that keeps a copy of the layer's input rather than the input (as LLaMA-Factory's
    unsloth option keeps one in host RAM), and reads its gradient from that copy."""

    @staticmethod
    def forward(ctx, run, hidden_states, *args):
        ctx.run, ctx.args = run, args
        ctx.save_for_backward(hidden_states.detach().clone())
        with torch.no_grad():
            return run(hidden_states, *args)

    @staticmethod
    def backward(ctx, grad):
        (hidden_states,) = ctx.saved_tensors
        hidden_states.requires_grad_(True)
        with torch.enable_grad():
            torch.autograd.backward(ctx.run(hidden_states, *ctx.args), grad)
        return (None, hidden_states.grad) + (None,) * len(ctx.args)


def test_a_checkpoint_that_lets_the_input_go_recomputes_as_before(four_layers, monkeypatch):
    # Nothing here holds a layer's input for the work ahead: where the checkpoint keeps only a copy, the input is
    # gone by backward, and the layer's recompute runs in the stock order. Layer 0's input, the embeddings' output
    # made to require grad, is a leaf that autograd holds: it is computed ahead, once per step.
    def enable(model):
        model.get_base_model()._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=CopyingCheckpoint.apply)
        model.enable_input_require_grads()

    monkeypatch.setenv("KT_SFT_RECOMPUTE_AHEAD", "0")
    reference = lora_model("qwen3_moe")
    enable(reference)
    expected = train(reference)
    monkeypatch.delenv("KT_SFT_RECOMPUTE_AHEAD")
    model = lora_model("qwen3_moe")
    enable(model)
    assert_same(train(model), expected)
    assert four_layers.count("ahead") == 2
