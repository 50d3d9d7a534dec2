"""Threads, async submission, bad input, device moves and construction paths of the engine."""
import io
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace

import pytest
import torch

import kt_sft
from experts_case import Shape, inputs, make_module, run_engine
from kt_sft._ext import _C, view
from kt_sft.nn.experts import ExpertWeight
from kt_sft.ops import timing
from kt_sft.ops.timing import engine_seconds, engine_timer, reset_engine_seconds

SHAPE = Shape("typical", T=64, H=96, I=80, E=8, K=3, r=5)


# Many rows per expert and few (as at decode, where an expert's column blocks are most of the work items).
# One row per expert of all 8 (decode_wide): the forward's items are 512 columns wide on 1 thread, 128 / 256 on 2,
# 128 on 3 (experts.cpp decode_width), and each output element comes out the same.
@pytest.mark.parametrize("shape", [SHAPE, replace(SHAPE, name="few_rows", T=3),
                                   replace(SHAPE, name="decode_wide", T=1, H=1100, I=700, K=8)],
                         ids=["many_rows", "few_rows", "decode_wide"])
def test_thread_counts_give_identical_results(shape):
    m = make_module(shape, lora=True, train_base=True)
    x, idx, w, g = inputs(shape)
    results = []
    for threads in (1, 2, 3):
        kt_sft.configure(threads=threads)
        results.append(run_engine(m, x, idx, w, g))
    kt_sft.configure(threads=0)
    for other in results[1:]:
        for key, t in results[0].items():
            assert torch.equal(t, other[key]), f"{key} differs between thread counts"


def test_thread_counts_out_of_range_are_refused_and_the_engine_keeps_running():
    # 100000 had the pool start threads until the OS stalled the process (it never returned).
    for threads in (100000, -1):
        with pytest.raises(ValueError, match=rf"threads={threads} is out of range: the engine takes 0 .* to \d+"):
            kt_sft.configure(threads=threads)
    m = make_module(SHAPE, lora=True)
    x, idx, w, _ = inputs(SHAPE)
    with torch.no_grad():
        assert torch.isfinite(m(x, idx, w)).all()


def test_deep_copy_is_refused_with_what_to_do_instead(module):
    import copy
    with pytest.raises(TypeError, match="cannot be deep-copied; for a reference model"):
        copy.deepcopy(module)
    import pickle
    with pytest.raises(TypeError, match="cannot be pickled .*save the weights instead"):  # the engine's bare error
        pickle.dumps(module)


@pytest.mark.parametrize("settings, match", [
    ({"threads": 1.7}, "threads, a whole number"),
    ({"tile_min_rows": -5}, "whole number of rows"),
    ({"tile_min_rows": 2**40}, "whole number of rows"),
    ({"kernels": 5}, "not a kernel set's name"),  # pybind's TypeError before
])
def test_settings_that_are_not_whole_numbers_in_range_are_refused(settings, match):
    before = kt_sft.capabilities()
    with pytest.raises(ValueError, match=match):
        kt_sft.configure(**settings)
    after = kt_sft.capabilities()
    assert (after["threads"], after["tile_min_rows"]) == (before["threads"], before["tile_min_rows"])


def test_meta_weights_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="meta device"):
        kt_sft.KTExperts(torch.zeros(2, 8, 4, device="meta"), torch.zeros(2, 4, 4, device="meta"))


def test_lora_alpha_must_be_finite():
    m = make_module(SHAPE, lora=False)
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="LoRA alpha must be a finite number"):
            m.add_lora(4, alpha)


@pytest.mark.parametrize("threads", [2, 5], ids=["2_threads", "5_threads_oversubscribed"])
def test_many_short_calls_in_a_row_repeat_their_results(threads):
    # Decode-sized calls back to back: pool threads take each job while spinning (without the pool's lock), or
    # sleep and are woken when oversubscribed; a job taken twice, missed or read stale would change a result.
    kt_sft.configure(threads=threads)
    try:
        m = make_module(SHAPE, lora=True)
        calls = [inputs(replace(SHAPE, T=T), dtype)[:3] for T in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]
        with torch.no_grad():
            first = [m(*c) for c in calls]
            for _ in range(100):
                for c, y in zip(calls, first):
                    assert torch.equal(m(*c), y)
    finally:
        kt_sft.configure(threads=0)


def test_async_submission_overlaps_python():
    m = make_module(SHAPE, lora=False)
    x, idx, w, _ = inputs(SHAPE)
    out = torch.empty_like(x)
    pending = m.engine.forward(view(x), view(idx), view(w), view(out), 0, 0.0, [None] * 6, False)
    # The GIL is free while the engine runs: Python keeps going and collects the result later.
    busy = sum(range(1000))
    assert pending.wait() is None and busy
    with torch.no_grad():
        assert torch.equal(out, m(x, idx, w))


def test_calls_run_now_wait_for_queued_calls():
    # Module calls run on the calling thread (now=True); they must not overlap a queued call, which shares the
    # engine's scratch: both results stay exact.
    big = Shape("queued", T=512, H=96, I=64, E=8, K=2)
    a, b = make_module(big, lora=False, seed=1), make_module(SHAPE, lora=True, seed=2)
    xa, ia, wa, _ = inputs(big)
    xb, ib, wb, _ = inputs(SHAPE)
    with torch.no_grad():
        want_a, want_b = a(xa, ia, wa), b(xb, ib, wb)
        out = torch.empty_like(xa)
        queued = [a.engine.forward(view(xa), view(ia), view(wa), view(out), 0, 0.0, [None] * 6, False)
                  for _ in range(3)]
        got_b = b(xb, ib, wb)
        for q in queued:
            q.wait()
    assert torch.equal(out, want_a) and torch.equal(got_b, want_b)


def test_capabilities_report_cpu_and_choice():
    caps = kt_sft.capabilities()
    assert caps["kernels"] in caps["runnable_kernels"]
    assert caps["runnable_kernels"][-1] == "reference"
    assert set(caps["cpu"]) >= {"avx2_fma", "avx512", "avx512_bf16", "amx_bf16"}


def test_huge_tile_min_rows_keeps_every_expert_off_the_tiles():
    # The forward's threshold is up to 4 × tile_min_rows in an int: configure clamps it so that it cannot wrap.
    shape = Shape("rows_for_tiles", T=48, H=64, I=48, E=2, K=1, r=4, routing="one")
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape, dtype=torch.bfloat16)
    try:
        kt_sft.configure(tile_min_rows=1 << 30)
        assert kt_sft.capabilities()["tile_min_rows"] == 1 << 24
        kt_sft.configure(tile_min_rows=1 << 20)
        off_tiles = run_engine(m, x, idx, w, g)
        kt_sft.configure(tile_min_rows=1 << 30)
        got = run_engine(m, x, idx, w, g)
    finally:
        kt_sft.configure(tile_min_rows=0)
    assert got.keys() == off_tiles.keys()
    for key, v in off_tiles.items():
        assert (v is None and got[key] is None) or torch.equal(got[key], v), key


def test_unknown_or_unrunnable_kernel_set_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cannot run on this CPU"):
        kt_sft.set_kernels("amx_tiles_of_the_future")
    assert kt_sft.capabilities()["kernels"] in kt_sft.capabilities()["runnable_kernels"]


@pytest.fixture
def module():
    return make_module(SHAPE, lora=True)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, i, w: (x.to(torch.int32), i, w), "floating|float32"),
        (lambda x, i, w: (x[:, :-1], i, w), r"\[T, 96\]"),
        (lambda x, i, w: (x, i[:-1], w[:-1]), "must both be"),
        (lambda x, i, w: (x, i.float(), w), "integer expert ids"),
        (lambda x, i, w: (x, torch.where(i == i[0, 0], 8, i), w), r"expert id 8 .* \[0, 8\)"),
        # -1 is the engine's "no expert", which only experts with zero-computation ones hand it (LongCat-Flash)
        (lambda x, i, w: (x, torch.where(i == i[0, 0], -1, i), w), r"expert id -1; ids must be in \[0, 8\)"),
        (lambda x, i, w: (x, torch.where(i == i[0, 0], -2, i), w), r"expert id -2 .* \(or -1: no expert\)"),
        (lambda x, i, w: (x, i, w.long()), "floating-point"),
        (lambda x, i, w: (x.to("meta"), i, w), "hidden_states is a meta tensor"),
        (lambda x, i, w: (x, i, w.to("meta")), "top_k_weights is a meta tensor"),
        # 2**30 tokens × 2 experts (expanded, no memory): past the engine's 32-bit slot numbers.
        (lambda x, i, w: (x[:1].expand(2**30, -1), i[:1, :2].expand(2**30, -1), w[:1, :2].expand(2**30, -1)),
         "32-bit integers"),
        (lambda x, i, w: (x.to_sparse(), i, w), "hidden_states is a torch.sparse_coo tensor"),  # torch's error before
    ],
    ids=["int_hidden", "wrong_hidden_size", "t_mismatch", "float_index", "index_ge_e", "no_expert", "negative_index",
         "int_weights", "meta_hidden", "meta_weights", "too_many_slots", "sparse_hidden"],
)
def test_bad_inputs_raise_clear_errors(module, mutate, match):
    x, idx, w, _ = inputs(SHAPE)
    x, idx, w = mutate(x, idx, w)
    with pytest.raises(ValueError, match=match):
        module(x, idx, w)


def test_inference_tensor_hidden_states_are_refused_by_a_training_forward_only(module):
    x, idx, w, _ = inputs(SHAPE)
    with torch.inference_mode():
        xi = x.clone()
    with pytest.raises(RuntimeError, match="inference tensor .* pass a clone made outside inference_mode"):
        module(xi, idx, w)  # torch's "Inference tensors do not track version counter." before
    with torch.no_grad():
        assert torch.equal(module(xi, idx, w), module(x, idx, w))


def test_non_contiguous_input_is_handled_and_raw_views_refuse_it(module):
    x, idx, w, _ = inputs(SHAPE)
    xt = torch.randn(SHAPE.H, SHAPE.T).T  # non-contiguous
    with torch.no_grad():
        assert torch.equal(module(xt, idx, w), module(xt.contiguous(), idx, w))
    with pytest.raises(ValueError, match="not contiguous"):
        view(xt, "hidden_states")


def test_nan_flagged_on_request(module):
    x, idx, w, _ = inputs(SHAPE)
    x[3, 4] = float("nan")
    module.check_finite = True
    with pytest.raises(ValueError, match="NaN or Inf"):
        module(x, idx, w)


def test_engine_checks_shapes_itself():
    gu = torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="down_proj has shape"):
        _C.Engine(2, 4, 4, view(gu), view(torch.zeros(2, 4, 3, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="must be bfloat16"):
        _C.Engine(2, 4, 4, view(gu.float()), view(torch.zeros(2, 4, 4, dtype=torch.bfloat16)))


def test_mismatched_weights_are_refused():
    with pytest.raises(ValueError, match="do not describe the same experts"):
        kt_sft.KTExperts(torch.zeros(2, 8, 4), torch.zeros(2, 4, 3))


def test_moves_leave_expert_weights_on_cpu_in_bf16(module):
    ptr = module.gate_up_proj.data_ptr()
    module.to(torch.float64)
    assert module.gate_up_proj.dtype == torch.bfloat16 and module.gate_up_proj.data_ptr() == ptr
    assert module.lora_A["default"]["gate"].dtype == torch.float32


def test_output_follows_input_dtype(module):
    x, idx, w, _ = inputs(SHAPE)
    with torch.no_grad():
        y = module(x.double(), idx, w.double())
    assert y.dtype == torch.float64


def test_per_expert_construction_matches_fused():
    m = make_module(SHAPE, lora=False)
    I = SHAPE.I
    gate = [m.gate_up_proj[e, :I] for e in range(SHAPE.E)]
    up = [m.gate_up_proj[e, I:] for e in range(SHAPE.E)]
    down = [m.down_proj[e] for e in range(SHAPE.E)]
    m2 = kt_sft.KTExperts.from_per_expert(gate, up, down)
    x, idx, w, _ = inputs(SHAPE)
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), m2(x, idx, w))


def test_lora_rank_and_projection_checks(module):
    with pytest.raises(ValueError, match="positive integer"):
        module.add_lora(0, 1.0)
    with pytest.raises(ValueError, match="unknown expert projections"):
        module.add_lora(4, 8.0, projections=("gate", "o_proj"))
    with pytest.raises(ValueError, match="'pissa_niter_16' is not supported on routed experts.*leave out pissa_init"):
        module.add_lora(4, 8.0, init="pissa_niter_16")  # what LLaMA-Factory's pissa_init passes
    with pytest.raises(ValueError, match="already hold a LoRA adapter 'default'; give the new one another name"):
        module.add_lora(4, 8.0, projections=("down",))  # it had replaced the trained adapter, without a word
    module = make_module(SHAPE, lora=False)
    module.add_lora(4, 8.0, projections=("down",))
    x, idx, w, g = inputs(SHAPE)
    grads = run_engine(module, x, idx, w, g)
    assert set(k for k in grads if k.startswith("d")) == {"dx", "dw", "dA_down", "dB_down"}


@pytest.mark.parametrize("train_base", [False, True], ids=["lora", "full"])
def test_autograd_grad_returns_every_gradient_and_leaves_param_grads_alone(train_base):
    # LoRA (and base) grads go straight into param.grad under backward(); torch.autograd.grad must get them
    # returned instead, and backward(inputs=...) must leave the parameters it does not name alone.
    m = make_module(SHAPE, lora=True, train_base=train_base)
    x, idx, w, g = inputs(SHAPE)
    expected = run_engine(m, x, idx, w, g)
    params = [p for p in m.parameters() if p.requires_grad]
    names = [f"d{n}_{p}" for n in ("A", "B") for p in ("gate", "up", "down")]
    if train_base:
        names += ["d_gate_up", "d_down"]
    by_param = dict(zip([*m.lora_A["default"].values(), *m.lora_B["default"].values(), m.gate_up_proj, m.down_proj],
                        names))
    for p in params:
        p.grad = None
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(m(xg, idx, wg), [xg, wg, *params], g)
    assert torch.equal(got[0], expected["dx"]) and torch.equal(got[1], expected["dw"])
    for p, t in zip(params, got[2:]):
        assert torch.equal(t, expected[by_param[p]]), by_param[p]
    assert all(p.grad is None for p in params)
    xg = x.clone().requires_grad_()
    m(xg, idx, w).backward(g, inputs=[xg])
    assert torch.equal(xg.grad, expected["dx"]) and all(p.grad is None for p in params)


def test_backward_after_freezing_a_lora_matrix_or_in_inference_mode(module):
    # A parameter frozen between forward and backward gets no gradient, as stock torch drops it; a backward run
    # under inference_mode works as outside it.
    x, idx, w, g = inputs(SHAPE)
    for p in module.parameters():
        p.grad = None
    a = module.lora_A["default"]["up"]
    y = module(x.clone().requires_grad_(), idx, w)
    a.requires_grad_(False)
    try:
        y.backward(g)
        assert a.grad is None and module.lora_B["default"]["up"].grad is not None
    finally:
        a.requires_grad_(True)
    expected = run_engine(module, x, idx, w, g)
    for p in module.parameters():
        p.grad = None
    xg = x.clone().requires_grad_()
    y = module(xg, idx, w)
    with torch.inference_mode():
        y.backward(g)
    assert torch.equal(xg.grad, expected["dx"]) and torch.equal(module.lora_A["default"]["up"].grad, expected["dA_up"])


def test_second_backward_is_refused(module):
    x, idx, w, g = inputs(SHAPE)
    y = module(x.requires_grad_(), idx, w)
    y.backward(g, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.backward(g)


def test_an_input_changed_in_place_between_forward_and_backward_is_refused(module):
    # On the CPU in float32 the engine reads x in place, and its backward reads x again: changed in between, the
    # LoRA grads came out of the new values without a word (autograd's saved tensors would have refused).
    x, idx, w, g = inputs(SHAPE)
    leaf = x.clone().requires_grad_()
    h = leaf * 1
    y = module(h, idx, w)
    with torch.no_grad():
        h.mul_(3)
    with pytest.raises(RuntimeError, match="hidden_states was changed in place"):
        y.backward(g)


@pytest.mark.parametrize("change", ["lora", "base", "merge"])
def test_weights_changed_between_forward_and_backward_are_refused(module, change):
    # The backward reads the weights again with the forward's activations: changed in between (an optimizer step
    # or a merge before backward), it would mix the two, so it refuses as autograd does for saved tensors.
    x, idx, w, g = inputs(SHAPE)
    y = module(x.requires_grad_(), idx, w)
    with torch.no_grad():
        if change == "lora":
            module.lora_B["default"]["down"].mul_(2)
        elif change == "base":
            module.down_proj.data.mul_(2)
        else:
            module.merge_lora("default")
    with pytest.raises(RuntimeError, match="changed in place between this forward and its backward"):
        y.backward(g)


def test_double_backward_is_refused(module):
    x, idx, w, g = inputs(SHAPE)
    x.requires_grad_()
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(module(x, idx, w), x, g, create_graph=True)


def test_a_lora_matrix_tied_across_projections_gets_the_sum_of_both_grads(module):
    x, idx, w, g = inputs(SHAPE)
    A = module.lora_A["default"]
    with torch.no_grad():
        A["up"].copy_(A["gate"])
    untied = run_engine(module, x, idx, w, g)
    A["up"] = A["gate"]
    for p in module.parameters():
        p.grad = None
    module(x, idx, w).backward(g)
    assert torch.equal(A["gate"].grad, untied["dA_gate"] + untied["dA_up"])


def test_a_tensor_hook_on_a_lora_matrix_sees_and_changes_its_grad(module):
    x, idx, w, g = inputs(SHAPE)
    plain = run_engine(module, x, idx, w, g)
    A = module.lora_A["default"]["gate"]
    seen = []
    handle = A.register_hook(lambda grad: seen.append(grad.clone()) or 2 * grad)
    hooked = run_engine(module, x, idx, w, g)
    handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], plain["dA_gate"])
    assert torch.equal(hooked["dA_gate"], 2 * plain["dA_gate"]) and torch.equal(hooked["dA_up"], plain["dA_up"])


def test_hooks_on_trainable_expert_weights_see_and_change_their_grads():
    # Full mode: the engine had written the grad into .grad and handed the tensor hook None.
    full = make_module(SHAPE, lora=False, train_base=True)
    x, idx, w, g = inputs(SHAPE)
    plain = run_engine(full, x, idx, w, g)
    seen, after = [], []
    full.gate_up_proj.register_hook(lambda grad: seen.append(grad.clone()) or 2 * grad)
    full.down_proj.register_post_accumulate_grad_hook(lambda p: after.append(p.grad.clone()))
    hooked = run_engine(full, x, idx, w, g)
    assert len(seen) == 1 and torch.equal(seen[0], plain["d_gate_up"])
    assert torch.equal(hooked["d_gate_up"], 2 * plain["d_gate_up"]) and torch.equal(hooked["d_down"], plain["d_down"])
    assert len(after) == 1 and torch.equal(after[0], plain["d_down"])


@pytest.mark.parametrize("keep", [lambda t: t, lambda t: t.detach(), lambda t: t.data, lambda t: t.view(-1)],
                         ids=["itself", "detach", "data", "view"])
def test_a_grad_kept_from_an_earlier_step_is_left_alone(module, keep):
    # The engine writes a LoRA grad into a buffer it reuses every step, unless someone still holds last step's
    # or shares its memory (.detach() and .data hold no reference to the grad itself).
    x, idx, w, g = inputs(SHAPE)
    A = module.lora_A["default"]["gate"]
    module(x, idx, w).backward(g)
    kept, first = keep(A.grad), A.grad.clone()
    module.zero_grad(set_to_none=True)
    module(x, idx, 0.5 * w).backward(g)
    assert torch.equal(kept.view_as(first), first) and A.grad.data_ptr() != kept.data_ptr()
    del kept
    buffer = A.grad.data_ptr()
    module.zero_grad(set_to_none=True)
    module(x, idx, w).backward(g)
    assert A.grad.data_ptr() == buffer and torch.equal(A.grad, first)


def test_base_grads_the_engine_cannot_add_into_are_accumulated_as_torch_does():
    # A strided grad left on a base weight (stock torch accumulates into it) had raised "tensor is not contiguous".
    # Bound: the BF16 sum rounds once (half a BF16 step, 2**-8 relative), on top of the BF16 grads compared.
    m = make_module(SHAPE, lora=False, train_base=True)
    x, idx, w, g = inputs(SHAPE)
    expected = run_engine(m, x, idx, w, g)
    for p in (m.gate_up_proj, m.down_proj):
        p.grad = torch.ones(p.shape[0], p.shape[2], p.shape[1], dtype=p.dtype).transpose(1, 2)
    m(x, idx, w).backward(g)
    assert torch.allclose(m.gate_up_proj.grad.float(), expected["d_gate_up"].float() + 1, rtol=2**-7, atol=2**-7)
    assert torch.allclose(m.down_proj.grad.float(), expected["d_down"].float() + 1, rtol=2**-7, atol=2**-7)


def test_the_lora_grad_buffers_of_a_deleted_adapter_are_freed(module):
    # They were kept by the matrices' ids for the module's life.
    x, idx, w, g = inputs(SHAPE)
    module(x.requires_grad_(), idx, w).backward(g)
    buffers = module.__dict__["_lora_grad_buffers"]
    assert len(buffers) == 6
    del module.lora_A["default"], module.lora_B["default"]
    import gc
    gc.collect()
    assert len(buffers) == 0


def test_two_threads_backward_through_one_module_sum_their_grads(module):
    # Both backwards find the LoRA grads None: each must not take the grad as its own (the later one's had
    # replaced the other's).
    cases = [inputs(SHAPE, seed=s) for s in (1, 2)]
    alone = [run_engine(module, *c) for c in cases]
    for _ in range(3):
        module.zero_grad(set_to_none=True)
        barrier = threading.Barrier(2)
        errors = []

        def train(x, idx, w, g):
            try:
                y = module(x, idx, w)
                barrier.wait()
                y.backward(g)
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=train, args=c) for c in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for name in ("gate", "up", "down"):
            for lora, key in ((module.lora_A, "dA"), (module.lora_B, "dB")):
                want = alone[0][f"{key}_{name}"] + alone[1][f"{key}_{name}"]
                assert torch.allclose(lora["default"][name].grad, want, rtol=1e-5, atol=1e-6), f"{key}_{name}"


def test_a_lora_matrix_with_other_strides_gets_its_grad_through_autograd():
    x, idx, w, g = inputs(SHAPE)
    plain = run_engine(make_module(SHAPE, lora=True), x, idx, w, g)
    module = make_module(SHAPE, lora=True)  # no grad buffer kept yet: one would be made with the matrix's strides
    A = module.lora_A["default"]["gate"]
    A.data = A.data.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, column-major
    assert not A.is_contiguous()
    assert torch.allclose(run_engine(module, x, idx, w, g)["dA_gate"], plain["dA_gate"], rtol=1e-6, atol=1e-7)


def test_a_backward_that_raised_leaves_the_grad_buffers_to_the_next(module, monkeypatch):
    # A backward that raised after choosing where its grads go, its graph still held (a stored exception): the
    # next backward must write into the module's buffers again, not each time into new ones.
    x, idx, w, g = inputs(SHAPE)
    A = module.lora_A["default"]["gate"]
    module(x, idx, w).backward(g)
    buffer = A.grad.data_ptr()
    module.zero_grad(set_to_none=True)
    y = module(x, idx, w)
    monkeypatch.setenv("KT_SFT_BACKWARD_COPY", "yes")  # refused when the backward reads it: after the choice
    with pytest.raises(ValueError, match="KT_SFT_BACKWARD_COPY"):
        y.backward(g)
    monkeypatch.delenv("KT_SFT_BACKWARD_COPY")
    module(x, idx, w).backward(g)
    assert A.grad.data_ptr() == buffer


def test_configure_from_two_threads_keeps_both_settings(monkeypatch):
    # Each call read the settings it leaves unspecified, then wrote all of them: two threads' calls in between
    # each other wrote back the other's old value. The first read here waits (up to 0.5 s) for a second one.
    from kt_sft import _ext
    real, second_read = _ext._C, threading.Event()
    reads = []

    class Engine:
        def __getattr__(self, name):
            return getattr(real, name)

        def capabilities(self):
            got = real.capabilities()
            reads.append(1)
            if len(reads) == 1:
                second_read.wait(0.5)
            else:
                second_read.set()
            return got

    before = kt_sft.capabilities()
    other = next(k for k in before["runnable_kernels"] if k != before["kernels"])
    monkeypatch.setattr(_ext, "_C", Engine())
    threads = [threading.Thread(target=kt_sft.configure, kwargs=kw) for kw in ({"threads": 1}, {"kernels": other})]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = real.capabilities()
        assert (after["threads"], after["kernels"]) == (1, other), after
    finally:
        monkeypatch.undo()
        kt_sft.configure(threads=before["threads"], kernels=before["kernels"])


def test_configure_from_another_thread_waits_for_calls_in_flight(module):
    # configure swaps the thread pool: a call running on the caller's thread (every CPU call) must not see the
    # pool freed under it, nor the grad clipping's sum of squares, which runs outside the engine calls.
    x, idx, w, g = inputs(SHAPE)
    expected = run_engine(module, x, idx, w, g)
    before = kt_sft.capabilities()["threads"]
    stop, errors = threading.Event(), []

    def reconfigure():
        try:
            for i in range(200):
                if stop.is_set():
                    break
                kt_sft.configure(threads=1 + i % 2)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=reconfigure)
    thread.start()
    try:
        for _ in range(40):
            got = run_engine(module, x, idx, w, g)
            assert torch.allclose(got["dA_up"], expected["dA_up"], rtol=1e-5, atol=1e-6)
            assert _C.sum_squares([view(got["dx"])]) == pytest.approx(float(expected["dx"].double().square().sum()),
                                                                     rel=1e-5)
    finally:
        stop.set()
        thread.join()
        kt_sft.configure(threads=before)
    assert not errors


def test_post_accumulate_grad_hooks_see_the_whole_grad(module):
    x, idx, w, g = inputs(SHAPE)
    plain = run_engine(module, x, idx, w, g)
    A = module.lora_A["default"]["up"]
    seen = []
    handle = A.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    run_engine(module, x, idx, w, g)
    handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], plain["dA_up"])


def test_data_assignment_keeps_weights_in_place_and_replacement_is_refused(module):
    x, idx, w, _ = inputs(SHAPE)
    with torch.no_grad():
        before = module(x, idx, w)
        ptr = module.down_proj.data_ptr()
        module.down_proj.data = module.down_proj.data * 1  # same values, another tensor: copied in
        assert module.down_proj.dtype == torch.bfloat16 and module.down_proj.data_ptr() == ptr
        assert torch.equal(module(x, idx, w), before)
        half = module.gate_up_proj.data.half()
        with pytest.warns(RuntimeWarning, match="float16 value given to a routed expert weight is copied"):
            module.gate_up_proj.data = half
        assert torch.equal(module.gate_up_proj.data, half.bfloat16())
    module.down_proj = torch.nn.Parameter(module.down_proj.detach().clone())
    with pytest.raises(RuntimeError, match="replaced by other tensors"):
        module(x, idx, w)


@pytest.mark.parametrize("when", ["before_forward", "before_backward"])
@pytest.mark.parametrize("change", ["scale_replaced", "codes_replaced", "storage_freed", "resized"])
def test_weights_whose_memory_the_engine_no_longer_owns_are_refused(when, change):
    # Each had the engine read freed memory (a segfault, or values ~1e12): the scales were not watched, and a
    # backward checked version counters only, which `.data =` and a storage's resize_ do not bump.
    m = make_module(SHAPE, lora=True, expert_format="bf16" if change in ("storage_freed", "resized") else "int4")
    x, idx, w, g = inputs(SHAPE)

    def apply():
        if change == "scale_replaced":
            m.gate_up_scale.data = m.gate_up_scale.data.clone()
        elif change == "codes_replaced":
            m.down_proj.data = m.down_proj.data.clone()
        elif change == "storage_freed":
            m.gate_up_proj.untyped_storage().resize_(0)
        else:
            with torch.no_grad():
                m.down_proj.resize_(1, 1, 1)

    if when == "before_forward":
        apply()
        with pytest.raises(RuntimeError, match="replaced by other tensors"):
            m(x, idx, w)
    else:
        y = m(x.requires_grad_(), idx, w)
        apply()
        with pytest.raises(RuntimeError, match="replaced by other tensors"):
            y.backward(g)


def test_lora_settings_that_would_go_wrong_silently_are_refused_or_applied():
    m = make_module(SHAPE, lora=False)
    with pytest.raises(ValueError, match="beyond float32's range"):  # the engine's scale is float32: it was inf
        m.add_lora(2, 1e39)
    m.add_lora(2, 4.0, adapter="foo", init=False)  # the first adapter of a plain KTExperts is applied (it was not)
    assert m.active_lora() == "foo"
    with pytest.raises(ValueError, match="pin='0' is neither True nor False"):  # bool("0") had turned pinning on
        kt_sft.configure(pin="0")


@pytest.mark.parametrize("optimizer", ["foreach", "fused", "for_loop"])
def test_upcast_gives_the_experts_a_float32_master(optimizer):
    """A trainer's upcast (`p.data = p.data.float()`) makes the parameter a float32 master that the optimizer
    updates; the engine reads BF16 weights rounded from it before the next forward, whatever the optimizer
    (a fused one bumps no version counter), and updates far below BF16's resolution add up in the master."""
    m = make_module(SHAPE, lora=False, train_base=True)
    x, idx, w, g = inputs(SHAPE)
    with torch.no_grad():
        before = m(x, idx, w)
    engine_ptrs = m._weights_read()
    for p in (m.gate_up_proj, m.down_proj):
        p.data = p.data.float()
    assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.float32
    assert m._weights_read() == engine_ptrs
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), before)
    opt = torch.optim.SGD([m.gate_up_proj, m.down_proj], lr=1.0, **{optimizer: True} if optimizer != "for_loop" else
                          {"foreach": False})
    start = m.down_proj.detach().clone()
    for _ in range(40):  # each step adds 2^-12 of the weights: every one below BF16's resolution (2^-8)
        m.gate_up_proj.grad = m.gate_up_proj.detach() * -2**-12
        m.down_proj.grad = m.down_proj.detach() * -2**-12
        opt.step()
    assert not torch.equal(m.down_proj.detach().bfloat16(), start.bfloat16())
    ref = kt_sft.KTExperts(m.gate_up_proj.detach().bfloat16(), m.down_proj.detach().bfloat16())
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), ref(x, idx, w))
    new = m.down_proj.detach().bfloat16() * 0.5
    m.down_proj.data = new  # copied into the master, then rounded for the engine
    ref.down_proj.data = new
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), ref(x, idx, w))
    m.down_proj.data.mul_(0.5)  # through .data, as weight averaging and some optimizers write
    ref.down_proj.data.mul_(0.5)
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), ref(x, idx, w))
    for value in (m.down_proj.detach()[0], m.down_proj.detach()[0].bfloat16(), torch.tensor(0.0)):
        with pytest.raises(ValueError, match="cannot take a value of shape"):
            m.down_proj.data = value  # copy_ would broadcast it over every expert
    m.zero_grad(set_to_none=True)
    m(x.clone().requires_grad_(), idx, w).backward(g)
    assert m.gate_up_proj.grad.dtype == m.down_proj.grad.dtype == torch.float32
    expected = run_engine(ref.requires_grad_(True), x, idx, w, g)
    assert torch.allclose(m.down_proj.grad.bfloat16().float(), expected["d_down"].float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("peft", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("load", ["copy", "swap", "assign"])
def test_load_state_dict_copies_into_the_weights_the_engine_reads(peft, master, load):
    """torch's loader would swap a weight's contents (the swap flag of torch.__future__) or replace it
    (assign=True); either left the engine reading tensors that are no longer the weights. Under a PEFT adapter
    the weights live on the `base_layer` child. The loader's hooks and checks still apply."""
    from kt_sft.peft.layer import KTExpertsLinear
    shape = replace(SHAPE, r=4)
    m = make_module(shape, lora=False, train_base=True)
    if peft:
        m = KTExpertsLinear(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone(), train_base=True)
        m.update_layer("default", 4, 8, init_lora_weights=False)
        m._disable_adapters = True
    if master:
        for p in (m.gate_up_proj, m.down_proj):
            p.data = p.data.float()
    engine_ptrs = m._weights_read()
    src = make_module(replace(shape, name="other"), lora=False)
    prefix = "base_layer." if peft else ""
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state[prefix + "gate_up_proj"] = src.gate_up_proj.detach().clone()
    state[prefix + "down_proj"] = src.down_proj.detach() * -3  # the hook below makes it -1.5 times src's
    hook = m.register_load_state_dict_pre_hook(lambda module, sd, pre, *args: sd[pre + prefix + "down_proj"].mul_(0.5))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(load == "swap")
    try:
        m.load_state_dict(state, assign=load == "assign")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    hook.remove()
    assert isinstance(m.down_proj, ExpertWeight) and m._weights_read() == engine_ptrs
    assert m.down_proj.dtype == (torch.float32 if master else torch.bfloat16)
    with torch.no_grad():
        src.down_proj.mul_(-1.5)
        x, idx, w, _ = inputs(shape)
        assert torch.equal(m(x, idx, w), src(x, idx, w))
    state[prefix + "down_proj"] = state[prefix + "down_proj"][:, :-1]
    with pytest.raises(RuntimeError, match=f"size mismatch for {prefix}down_proj"):
        m.load_state_dict(state)
    del state[prefix + "gate_up_proj"], state[prefix + "down_proj"]
    assert m.load_state_dict(state, strict=False).missing_keys == [prefix + "gate_up_proj", prefix + "down_proj"]


def test_a_warning_past_an_ignore_filter_is_logged_once(caplog):
    # As the default filter shows a warning once per place: a per-layer warning had been logged at every call.
    from kt_sft._ext import warn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            warn("kt_sft: a message of this test")
    assert [r.levelname for r in caplog.records if "a message of this test" in r.getMessage()] == ["WARNING"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_is_refused_at_every_stage(monkeypatch, stage):
    # Only ZeRO-3 had been refused; ZeRO-1/2 point parameters into flat buffers that the engine's experts, read in
    # place, would not follow. What TrainingArguments(deepspeed=...) registers, without deepspeed installed.
    from transformers.integrations import deepspeed

    from kt_sft._ext import require_one_process
    registered = type("Config", (), {"config": {"zero_optimization": {"stage": stage}}})()
    monkeypatch.setattr(deepspeed, "_hf_deepspeed_config_weak_ref", lambda: registered)
    with pytest.raises(ValueError, match=f"DeepSpeed \\(ZeRO stage {stage}\\) .* remove the deepspeed setting"):
        require_one_process()


@pytest.mark.parametrize("world, refused", [("2", True), (" 2", True), ("1", False), ("", False), ("abc", False),
                                            ("\u00b2", False)])
def test_a_distributed_launch_is_refused(monkeypatch, world, refused):
    from kt_sft._ext import require_one_process
    monkeypatch.setenv("WORLD_SIZE", world)
    if refused:
        with pytest.raises(ValueError, match="distributed launch"):
            require_one_process()
    else:
        require_one_process()


def test_frozen_expert_weights_take_no_float32_master(module):
    x, idx, w, _ = inputs(SHAPE)
    with torch.no_grad():
        before = module(x, idx, w)
    ptr = module.down_proj.data_ptr()
    module.down_proj.data = module.down_proj.data.float()  # as a blanket upcast of every parameter would
    assert module.down_proj.dtype == torch.bfloat16 and module.down_proj.data_ptr() == ptr
    with torch.no_grad():
        assert torch.equal(module(x, idx, w), before)


def test_float32_master_under_peft_merge_disable_and_unload():
    """A forward with adapters disabled unmerges them from the master first, then runs on weights rounded from
    it; unloading keeps the same master over the same BF16 weights."""
    from kt_sft.peft.layer import KTExpertsLinear
    shape = replace(SHAPE, r=4)
    base = make_module(shape, lora=False, train_base=True)
    m = KTExpertsLinear(base.gate_up_proj.detach().clone(), base.down_proj.detach().clone(), train_base=True)
    m.update_layer("default", 4, 8, init_lora_weights=False)
    for p in (m.gate_up_proj, m.down_proj):
        p.data = p.data.float()
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        plain = base(x, idx, w)
        m.merge()
        m._disable_adapters = True
        assert torch.equal(m(x, idx, w), plain)
    unloaded = m.unload_and_optionally_merge_module(False, False, None)
    assert unloaded._weights_read() == m._weights_read()
    assert unloaded.gate_up_proj.dtype == torch.float32
    assert unloaded.gate_up_proj.data_ptr() == m.gate_up_proj.data_ptr()


def test_non_contiguous_grad_output_is_copied_and_kept_alive(module):
    x, idx, w, g = inputs(SHAPE)
    expected = run_engine(module, x, idx, w, g)["dx"]
    xg = x.clone().requires_grad_()
    module(xg, idx, w).backward(g.T.contiguous().T)  # same values, other strides: the engine gets a copy
    assert torch.equal(xg.grad, expected)


def test_dropping_a_call_in_flight_is_safe():
    m = make_module(SHAPE, lora=False)
    x, idx, w, _ = inputs(SHAPE)
    for _ in range(3):  # the handle and every tensor go at once; the call finishes before they are freed
        m.engine.forward(view(x.clone()), view(idx.clone()), view(w.clone()), view(torch.empty_like(x)), 0, 0.0,
                         [None] * 6, False)


def test_step_profile_counts_engine_phases_and_transfers():
    shape = Shape("profile", T=16, H=32, I=16, E=4, K=2)
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape)
    reset_engine_seconds()
    m(x.requires_grad_(), idx, w).backward(g)
    spent = engine_seconds()
    assert set(spent) == {"forward", "backward", "transfer", "gpu"}, spent
    assert all(spent[k] > 0 for k in ("forward", "backward", "transfer")) and spent["gpu"] == 0, spent  # CPU inputs
    reset_engine_seconds()
    assert not any(engine_seconds().values())


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.2)
        return g


def test_step_profile_leaves_out_what_runs_beside_an_engine_call_that_ran_at_once():
    # On the CPU the engine runs at once; the step profile counted, as the engine's, the work queued beside it
    # (a block's shared experts) in forward, and in backward the nodes that work made: 200 ms each here.
    shape = Shape("profile", T=16, H=32, I=16, E=4, K=2)
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape)
    shared = torch.ones(shape.T, shape.H, requires_grad=True)
    made = []
    m.queue_beside(lambda: (time.sleep(0.2), made.append(SlowBackward.apply(shared))))
    reset_engine_seconds()
    out = m(x.requires_grad_(), idx, w)
    ((out + made[0]) * g).sum().backward()
    spent = engine_seconds()
    assert spent["forward"] < 0.1 and spent["backward"] < 0.1, spent
    assert shared.grad is not None


def test_step_profile_cycles_leave_out_evaluations_and_passes_without_grad(monkeypatch):
    # An evaluation between two training forwards had been counted in the next step's line; a training-mode pass
    # without grad (a DPO reference pass) had split one step into two lines.
    from kt_sft.ops import step_profile
    clock = iter([0.0, 5.0, 6.0, 7.0])  # read by the training forwards only
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    profile = step_profile.StepProfile(1, out)
    decoder = torch.nn.Linear(1, 1)
    for training, grad in [(True, True), (False, False), (True, True), (True, True), (True, False), (True, True)]:
        decoder.train(training)
        with torch.set_grad_enabled(grad):
            profile(decoder, (), {})
    lines = [line.split(" = ")[0] for line in out.getvalue().splitlines() if line.startswith("kt_sft step")]
    assert lines == ["kt_sft step 1: 1000 ms", "kt_sft step 2: 1000 ms"], out.getvalue()


def phases_of(call):
    """The engine's phase profile of call() (profiling on for it only), and the call's wall time."""
    timing.profile_engine_phases(True)
    try:
        timing.engine_phases(reset=True)
        t0 = time.perf_counter()
        call()
        wall = time.perf_counter() - t0
        return timing.engine_phases(reset=True), wall
    finally:
        timing.profile_engine_phases(False)


def test_engine_phase_profile_splits_each_call_while_on():
    shape = Shape("phases", T=16, H=32, I=16, E=4, K=2, r=3)
    m = make_module(shape, lora=True)
    x, idx, w, g = inputs(shape)
    phases, wall = phases_of(lambda: m(x.requires_grad_(), idx, w).backward(g))
    assert list(phases) == ["forward.route_inputs", "forward.pack_x_lora_in", "forward.gate_up",
                            "forward.lora_in_down", "forward.down_slots", "forward.combine", "backward.inputs",
                            "backward.pack_dout_lora", "backward.dout_down", "backward.dw_sum", "backward.lora_dg_du",
                            "backward.dx", "backward.dx_sum", "backward.weight_grads"], phases
    assert all(v >= 0 for v in phases.values()) and 0 < sum(phases.values()) <= wall, (phases, wall)
    assert timing.engine_phases() == {}  # reset, and nothing added while off:
    m(x, idx, w)
    assert timing.engine_phases() == {}


def test_decode_calls_run_gate_up_and_down_as_one_phase():
    # Every expert at most two rows: down's items wait on their own expert's gate/up items only, in one phase.
    shape = Shape("phases_decode", T=2, H=96, I=80, E=8, K=3, r=5)
    m = make_module(shape, lora=True)
    x, idx, w, _ = inputs(shape)
    with torch.no_grad():
        phases, _ = phases_of(lambda: m(x, idx, w))
    assert list(phases) == ["forward.route_inputs", "forward.pack_x_lora_in", "forward.gate_up_down",
                            "forward.combine"], phases


def test_nested_engine_timers_are_exclusive(monkeypatch):
    clock = iter([10.0, 12.0, 17.0])  # transfer opens, gpu opens, gpu closes, transfer closes
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock, 20.0))
    reset_engine_seconds()
    with engine_timer("transfer"):
        with engine_timer("gpu"):
            pass
    assert engine_seconds() == {"forward": 0.0, "backward": 0.0, "transfer": 5.0, "gpu": 5.0}
    reset_engine_seconds()


def beside_a_forward_span(first) -> dict:
    """engine_seconds() after first(ready, added) ran in a thread beside another that adds a 5 s forward span once
    first sets ready, then sets added."""
    reset_engine_seconds()
    ready, added = threading.Event(), threading.Event()

    def other():
        ready.wait(10)
        timing.add_engine_seconds("forward", 5.0)
        added.set()

    threads = [threading.Thread(target=first, args=(ready, added)), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = engine_seconds()
    reset_engine_seconds()
    return spent


def test_engine_timers_of_two_threads_keep_to_their_own_phases():
    # One stack of open phases for the process: another thread's engine span was taken out of this thread's open
    # transfer (which went negative).
    def transfer(ready, added):
        with engine_timer("transfer"):
            ready.set()
            added.wait(10)

    spent = beside_a_forward_span(transfer)
    assert spent["forward"] == 5.0 and 0 <= spent["transfer"] < 5.0, spent


def test_uncounted_leaves_other_threads_spans_counted():
    # It restored the totals on leaving, taking out what other threads (an inference thread beside training)
    # had added meanwhile.
    def beside(ready, added):
        with timing.uncounted():
            ready.set()
            added.wait(10)
            timing.add_engine_seconds("transfer", 3.0)  # this thread's, uncounted

    spent = beside_a_forward_span(beside)
    assert spent["forward"] == 5.0 and spent["transfer"] == 0.0, spent


def test_doctor_reports_what_this_machine_runs(capsys, monkeypatch):
    from kt_sft.cli import main
    monkeypatch.setenv("KT_SFT_LORA_ON_GPU", "1")
    monkeypatch.delenv("KT_SFT_BACKWARD_COPY", raising=False)
    assert main(["doctor"]) == 0  # every machine that runs this suite can run the kernels
    out = capsys.readouterr().out
    assert "KT_SFT_BACKWARD_COPY=0, KT_SFT_LORA_ON_GPU=1" in out
    assert f"in use: {kt_sft.capabilities()['kernels']}" in out
    assert "GiB of it available to this process" in out
    assert "libraries        : transformers " in out


def test_doctor_names_what_newer_peft_changes(monkeypatch, capsys):
    from kt_sft import cli
    monkeypatch.setattr(cli, "installed", lambda name: {"peft": "0.21.0"}.get(name))
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "transformers not installed, peft 0.21.0, llamafactory not installed" in out
    assert "note             : peft 0.21.0 leaves a model's parameters as trainable" in out


def test_a_daemon_thread_that_ran_the_experts_finishes_before_the_interpreter_exits(tmp_path):
    # llamafactory-cli chat generates in a daemon thread; stopped by Python's shutdown while torch released a
    # tensor, that thread aborted the process (SIGABRT) in about one exit of five with a tiny FP8 model. Such a
    # thread now gets JOIN_SECONDS to finish; here its last work after the experts takes 0.3 s.
    done = tmp_path / "done"
    script = f"""
import threading, time, torch, kt_sft
m = kt_sft.KTExperts(torch.randn(4, 16, 8).bfloat16(), torch.randn(4, 8, 8).bfloat16())
def generate():
    m(torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))
    called.set()
    time.sleep(0.3)
    open({str(done)!r}, "w").close()
called = threading.Event()
threading.Thread(target=generate, daemon=True).start()
called.wait(60)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and not ran.stderr, ran.stderr
    assert done.exists()
    # A thread threading did not start (autograd's device threads run checkpointing's recompute) cannot be joined:
    # it is left alone, where joining it had raised at every exit.
    foreign = script.replace("threading.Thread(target=generate, daemon=True).start()",
                             "import _thread; _thread.start_new_thread(generate, ())")
    ran = subprocess.run([sys.executable, "-c", foreign], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and not ran.stderr, ran.stderr
