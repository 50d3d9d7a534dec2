"""A training-mode forward without grad (gradient checkpointing's first pass) keeps the engine's pass, and the
forward with grad that follows takes it only when nothing that shapes the result changed
(kt_sft/ops/kept_forward.py): same results and gradients as running the engine, bit for bit."""
import pytest
import torch
from experts_case import Shape, inputs, make_module, run_engine

import kt_sft.ops.experts_function as function_module
import kt_sft.ops.kept_forward as kept_forward
from kt_sft.ops import host_memory
from kt_sft.ops.kept_forward import MISSES_BEFORE_OFF

SHAPE = Shape("typical", T=40, H=64, I=48, E=8, K=2)


@pytest.fixture(autouse=True)
def recompute_outside_backward(monkeypatch):
    """These tests run the recompute as a plain grad forward; only a forward inside backward may take a kept pass
    (tests/models/test_gradient_checkpointing.py runs the real one, and the last test here the refusal)."""
    monkeypatch.setattr("kt_sft.nn.experts.recomputing", lambda: True)


def first_pass(m, x, idx, w):
    with torch.no_grad():
        return m(x, idx, w)


def fresh(shape=SHAPE, dropout=0.0):
    m = make_module(shape, lora=True)
    m.lora_dropout["default"].p = dropout
    m.train()
    return m


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "lora_dropout"])
def test_recompute_takes_the_kept_pass(dropout, monkeypatch):
    x, idx, w, g = inputs(SHAPE)
    twin = fresh(dropout=dropout)
    torch.manual_seed(5)
    expected = run_engine(twin, x, idx, w, g)
    m = fresh(dropout=dropout)
    torch.manual_seed(5)
    y0 = first_pass(m, x, idx, w)
    assert m.__dict__["_kept"] is not None
    calls = []
    real = function_module.start_forward  # every engine forward starts there
    monkeypatch.setattr(function_module, "start_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(5)  # checkpointing restores the RNG before the recompute
    got = run_engine(m, x, idx, w, g)
    assert calls == [], "the recompute ran the engine although the kept pass matched"
    assert m.__dict__.get("_kept") is None
    assert torch.equal(y0, got["y"])
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k


def changed_input(m, x, idx, w):
    return x + 1, idx, w


def changed_routing(m, x, idx, w):
    return x, idx.roll(1, 0), w


def changed_weights(m, x, idx, w):
    with torch.no_grad():
        m.lora_B["default"]["up"].add_(0.01)  # an optimizer step between the passes
    return x, idx, w


def changed_seed(m, x, idx, w):
    m.lora_dropout["default"].p = 0.3
    torch.manual_seed(11)
    return x, idx, w


@pytest.mark.parametrize("change", [changed_input, changed_routing, changed_weights, changed_seed])
def test_a_changed_forward_runs_the_engine(change):
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    torch.manual_seed(5)
    first_pass(m, x, idx, w)
    x2, idx2, w2 = change(m, x, idx, w)
    state = torch.get_rng_state()
    got = run_engine(m, x2, idx2, w2, g)
    twin = fresh()
    twin.load_state_dict(m.state_dict())
    twin.lora_dropout["default"].p = m.lora_dropout["default"].p
    torch.set_rng_state(state)
    expected = run_engine(twin, x2, idx2, w2, g)
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k


def test_nothing_is_kept_in_eval_mode_or_when_turned_off(monkeypatch):
    x, idx, w, _ = inputs(SHAPE)
    m = fresh()
    m.eval()
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None
    m.train()
    monkeypatch.setenv("KT_SFT_RECOMPUTE_EXPERTS", "1")
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None


def test_the_first_pass_result_is_not_the_kept_one():
    # On the CPU the caller's result would otherwise be the very tensor the recompute hands out again.
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    y0 = first_pass(m, x, idx, w)
    y0.zero_()
    got = run_engine(m, x, idx, w, g)
    assert got["y"].abs().sum() > 0


def test_a_module_whose_recomputes_keep_missing_stops_keeping():
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    for i in range(MISSES_BEFORE_OFF):
        first_pass(m, x, idx, w)
        if i == MISSES_BEFORE_OFF - 1:
            with pytest.warns(RuntimeWarning, match="no longer keep their first pass"):
                run_engine(m, x + 1, idx, w, g)
        else:
            run_engine(m, x + 1, idx, w, g)
    first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None


def fake_host(tmp_path, meminfo_kb=None, cgroup_line="0::/job", files=None):
    """A /proc and a /sys/fs/cgroup holding just what host_headroom reads."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    if meminfo_kb:
        available, total = meminfo_kb
        (proc / "meminfo").write_text(f"MemTotal: {total} kB\nMemFree: 1 kB\nMemAvailable: {available} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in (files or {}).items():
        (cgroup / rel).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / rel).write_text(text)
    return str(proc), str(cgroup)


def test_host_headroom_reads_meminfo_and_the_tighter_cgroup_limit(tmp_path):
    gib = 1 << 30
    assert host_memory.host_headroom(*fake_host(tmp_path / "a", (8 << 20, 16 << 20))) == (8 * gib, 16 * gib)
    v2 = {"job/memory.max": f"{4 * gib}\n", "job/memory.current": f"{3 * gib}\n",
          "job/memory.stat": f"anon 1\ninactive_file {gib}\n"}
    # 4 GiB limit, 3 GiB used of which 1 GiB is reclaimable cache: 2 GiB left, tighter than MemAvailable.
    assert host_memory.host_headroom(*fake_host(tmp_path / "b", (8 << 20, 16 << 20), files=v2)) == (2 * gib, 4 * gib)
    unlimited = {**v2, "job/memory.max": "max\n"}
    assert host_memory.host_headroom(*fake_host(tmp_path / "c", (8 << 20, 16 << 20), files=unlimited)) == \
        (8 * gib, 16 * gib)
    v1 = {"memory/job/memory.limit_in_bytes": f"{6 * gib}", "memory/job/memory.usage_in_bytes": f"{5 * gib}",
          "memory/job/memory.stat": f"cache 9\ntotal_inactive_file {2 * gib}\n"}
    assert host_memory.host_headroom(*fake_host(tmp_path / "d", None, "4:memory:/job\n0::/", v1)) == \
        (3 * gib, 6 * gib)
    v1_unlimited = {**v1, "memory/job/memory.limit_in_bytes": "9223372036854771712"}
    assert host_memory.host_headroom(*fake_host(tmp_path / "e", None, "4:memory:/job", v1_unlimited)) is None


def test_host_headroom_finds_a_limit_set_above_the_process_or_at_a_containers_root(tmp_path):
    # Both were missed, the whole machine's MemAvailable planned against: a v2 limit on a parent (a Slurm job over
    # its step's task), and a v1 container without its own cgroup namespace (its cgroup mounted as the root while
    # /proc/self/cgroup names the host's path).
    gib = 1 << 30
    parent = {"job/memory.max": f"{8 * gib}\n", "job/memory.current": f"{6 * gib}\n",
              "job/memory.stat": "inactive_file 0\n", "job/step/task/memory.max": "max\n",
              "job/step/task/memory.current": f"{6 * gib}\n", "job/step/task/memory.stat": "inactive_file 0\n"}
    assert host_memory.host_headroom(*fake_host(tmp_path / "a", (200 << 20, 256 << 20), "0::/job/step/task",
                                                parent)) == (2 * gib, 8 * gib)
    tighter_below = {**parent, "job/step/task/memory.max": f"{7 * gib}\n"}  # 1 GiB left there, 2 in the job
    assert host_memory.host_headroom(*fake_host(tmp_path / "b", (200 << 20, 256 << 20), "0::/job/step/task",
                                                tighter_below)) == (1 * gib, 7 * gib)
    container = {"memory/memory.limit_in_bytes": f"{8 * gib}", "memory/memory.usage_in_bytes": f"{6 * gib}",
                 "memory/memory.stat": "total_inactive_file 0\n"}
    assert host_memory.host_headroom(*fake_host(tmp_path / "c", (200 << 20, 256 << 20), "4:memory:/docker/abc",
                                                container)) == (2 * gib, 8 * gib)


def test_a_pass_is_not_kept_where_host_ram_is_short(monkeypatch):
    x, idx, w, g = inputs(SHAPE)
    expected = run_engine(fresh(), x, idx, w, g)
    gib = 1 << 30
    monkeypatch.setattr(kept_forward, "_warned_short", False)
    monkeypatch.setattr(kept_forward, "host_headroom", lambda: (3 * gib, 100 * gib))  # reserve: 5 GiB
    m = fresh()
    with pytest.warns(RuntimeWarning, match="host RAM available"):
        first_pass(m, x, idx, w)
    assert m.__dict__.get("_kept") is None
    got = run_engine(m, x, idx, w, g)
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k
    monkeypatch.setattr(kept_forward, "host_headroom", lambda: (6 * gib, 100 * gib))
    first_pass(m, x, idx, w)
    assert m.__dict__["_kept"] is not None
    # The saved-buffer pool's free buffers are room too: a kept pass takes them before asking the OS.
    monkeypatch.setattr(kept_forward, "host_headroom", lambda: (3 * gib, 100 * gib))
    monkeypatch.setattr(kept_forward._C, "saved_pool_free_bytes", lambda: 3 * gib)
    first_pass(m, x, idx, w)
    assert m.__dict__["_kept"] is not None


def test_free_saved_buffers_count_as_room():
    from kt_sft._ext import _C
    _C.saved_pool_release()
    assert _C.saved_pool_free_bytes() == 0
    x, idx, w, g = inputs(SHAPE)
    run_engine(fresh(), x, idx, w, g)  # its saved g/u go back to the pool after backward
    assert _C.saved_pool_free_bytes() >= 2 * SHAPE.T * SHAPE.K * SHAPE.I * 4


def test_inputs_match_bit_for_bit():
    same = kept_forward.same_bits
    for n in (0, 3, 4, 4099):  # byte counts that are and are not whole int64 words, as bf16
        a = torch.randn(n).bfloat16()
        assert same(a, a.clone())
        if n:
            b = a.clone()
            b[-1] = b[-1] * 2 + 1
            assert not same(a, b)
    assert not same(torch.zeros(4), -torch.zeros(4)), "−0 and +0 are other inputs to the engine"
    assert same(torch.full((4,), float("nan")), torch.full((4,), float("nan")))
    assert not same(torch.zeros(4), torch.zeros(2, 2)) and not same(torch.zeros(4), torch.zeros(4).double()[:4])
    # Contiguous views that start 4 bytes into their storage (a routing-weight row sliced off): no int64 view
    # exists there, and the comparison had raised inside checkpointing's backward.
    base = torch.rand(9, 1)  # K = 1: each row 4 bytes
    assert same(base[1:5], base.clone()[1:5]) and not same(base[1:5], base[3:7])


def test_only_a_recompute_inside_backward_takes_the_kept_pass(monkeypatch):
    # A no-grad training-mode pass (a logging pass) that no backward followed, weights changed through `.data`
    # (no version counter sees it), then a grad forward on the same inputs: it must run the engine.
    monkeypatch.undo()
    x, idx, w, g = inputs(SHAPE)
    m = fresh()
    first_pass(m, x, idx, w)
    m.lora_B["default"]["up"].data.add_(0.01)
    got = run_engine(m, x, idx, w, g)
    twin = fresh()
    twin.load_state_dict(m.state_dict())
    expected = run_engine(twin, x, idx, w, g)
    for k, v in expected.items():
        assert (v is None and got[k] is None) or torch.equal(v, got[k]), k

