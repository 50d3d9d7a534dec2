"""Gradient clipping with the engine's sum of squares (kt_sft/ops/grad_clip.py) against torch's own.

Tolerances: the norm is summed in float64 here and by torch per tensor in float32 with a cascade, so the two
norms agree to float32 rounding (rtol 1e-6); the clipped gradients inherit that relative error once each."""
import pytest
import torch

import kt_sft
from kt_sft._ext import _C, view
from kt_sft.ops import grad_clip

torch_clip = grad_clip._torch_clip_grad_norm


def params(device="cpu"):
    """CPU float32 gradients over many of the engine's chunks, a bf16 one, an odd-sized one, an empty one, a
    non-contiguous one (torch's), one on `device`, and a parameter without a gradient."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.empty(s)) for s in [(3, 70001), (5, 7), (0,), (40, 30)]]
    ps += [torch.nn.Parameter(torch.empty(33, device=device)), torch.nn.Parameter(torch.empty(9))]
    ps.append(torch.nn.Parameter(torch.empty(2, 3, dtype=torch.bfloat16)))
    for p in ps[:-3]:
        p.grad = torch.randn_like(p)
    ps[3].grad = torch.randn(30, 40).t()  # not contiguous: torch's norm
    ps[4].grad = torch.randn(33, device=device)
    ps[-1].grad = torch.randn(2, 3, dtype=torch.bfloat16)
    return ps  # ps[5] has no gradient


def clone(ps):
    out = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, out):
        q.grad = None if p.grad is None else p.grad.clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_matches_float64_and_any_thread_count(dtype):
    ts = [torch.randn(n).to(dtype) for n in (1, 3, 65536, 65537, 200003, 0)]
    want = sum(float(t.double().square().sum()) for t in ts)
    got = []
    for threads in (1, 2, 3):
        kt_sft.configure(threads=threads)
        got.append(_C.sum_squares([view(t) for t in ts]))
    kt_sft.configure(threads=0)
    assert got[0] == got[1] == got[2]
    assert got[0] == pytest.approx(want, rel=1e-12)


def test_sum_squares_refuses_integer_tensors():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _C.sum_squares([view(torch.zeros(3, dtype=torch.int64))])


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clipped", "under_the_limit"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the GPU test machine)"))])
def test_clip_matches_torch(max_norm, device):
    ours = params(device)
    theirs = clone(ours)
    total = grad_clip.clip_grad_norm_(ours, max_norm)
    want = torch_clip(theirs, max_norm)
    assert total.device == want.device
    torch.testing.assert_close(total, want.float(), rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        if p.grad is None:
            assert q.grad is None
        elif max_norm > 1:
            assert torch.equal(p.grad, q.grad), "gradients under the limit must come back unchanged"
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-6 if p.grad.dtype == torch.float32 else 1e-2, atol=0)


def test_other_norm_types_and_no_cpu_gradient_go_to_torch():
    nonempty = [p for p in params() if p.numel()]  # torch has no infinity norm of an empty tensor
    for norm_type, ps in ((float("inf"), nonempty), (1.0, params()), (2.0, [params()[3]])):
        ours, theirs = ps, clone(ps)
        assert torch.equal(grad_clip.clip_grad_norm_(ours, 0.5, norm_type), torch_clip(theirs, 0.5, norm_type))
        for p, q in zip(ours, theirs):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_non_finite_norm_raises_on_request_and_poisons_gradients_like_torch():
    ps = params()
    ps[0].grad[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite loss or gradient"):
        grad_clip.clip_grad_norm_(clone(ps), 1.0, error_if_nonfinite=True)
    ours, theirs = ps, clone(ps)
    assert grad_clip.clip_grad_norm_(ours, 1.0).isnan() and torch_clip(theirs, 1.0).isnan()
    for p, q in zip(ours, theirs):
        assert (p.grad is None and q.grad is None) or (p.grad.isnan().all() and q.grad.isnan().all())


def test_float64_gradients_keep_a_float64_norm_and_large_norms_do_not_overflow():
    # The norm had been cast to float32: 1e40 became inf, and every gradient was zeroed; a float32 norm of 1e21
    # became inf beside a float16 gradient (their float32 combination overflowed).
    a, b = torch.nn.Parameter(torch.zeros(100, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(50))
    a.grad, b.grad = torch.full((100,), 1e39, dtype=torch.float64), torch.ones(50)
    total = grad_clip.clip_grad_norm_([a, b], 1.0)
    assert total.dtype == torch.float64 and total.item() == pytest.approx(1e40, rel=1e-6)
    assert a.grad[0].item() == pytest.approx(0.1, rel=1e-5) and torch.all(b.grad > 0)
    c, d = torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
    c.grad, d.grad = torch.full((100,), 1e20), torch.ones(5, dtype=torch.float16)
    assert grad_clip.clip_grad_norm_([c, d], 1.0).item() == pytest.approx(1e21, rel=1e-6)
    assert torch.isfinite(c.grad).all() and c.grad[0].item() == pytest.approx(0.1, rel=1e-5)


def test_an_empty_generator_is_warned_about_as_torch_does():
    with pytest.warns(UserWarning, match="empty generator"):
        assert grad_clip.clip_grad_norm_((p for p in []), 1.0).item() == 0.0


def test_cpu_experts_install_it_for_the_trainers():
    from experts_case import Shape, make_module
    make_module(Shape("tiny", T=4, H=16, I=8, E=2, K=1, r=2), lora=True)
    assert torch.nn.utils.clip_grad_norm_ is grad_clip.clip_grad_norm_
