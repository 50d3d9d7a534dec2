"""The engine across a process's life: fork() (DataLoader workers, datasets' map), interpreter exit with calls
queued or running, and settings kept between configure() calls. Each case runs in a fresh interpreter, since a
hang or a crash there is the failure."""
import os
import subprocess
import sys
import textwrap

import kt_sft

# A forked child's fate, seen from the parent: its exit status, or "hung" when it did not exit in time.
WAIT_FOR_CHILD = """
import os, time
def child_status(pid, seconds=60):
    end = time.time() + seconds
    while time.time() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"
"""

# Engine calls of a second or so on two cores: long enough to be in flight at a fork or at exit. A call makes no
# tensor: torch's own functions give the GIL back through frames that abort a daemon thread the shutdown ends there
# (pytorch#38228), which would make the exit cases below fail for torch's sake.
LONG_CALLS = """
import torch
from kt_sft._ext import _C, view
E, H, I, T, K = 8, 1024, 1024, 2048, 4
gu, dn = (torch.randn(E, 2 * I, H) / 32).bfloat16(), (torch.randn(E, H, I) / 32).bfloat16()
engine = _C.Engine(E, H, I, view(gu), view(dn))
x, w, idx, out = torch.randn(T, H), torch.rand(T, K), torch.randint(0, E, (T, K)), torch.empty(T, H)
views = view(x), view(idx), view(w), view(out)
def queued_call():
    return engine.forward(*views, 0, 0.0, [None] * 6, False, now=False)
"""


def run_script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=300)


def test_a_forked_child_runs_the_experts_and_exits():
    # The child has none of the parent's engine threads: its first call had waited for them forever, and a child
    # that never called the engine hung in its exit, joining them.
    ran = run_script(WAIT_FOR_CHILD + """
import sys, torch, kt_sft
m = kt_sft.KTExperts(torch.randn(4, 16, 8).bfloat16(), torch.randn(4, 8, 8).bfloat16())
x, idx, w = torch.randn(5, 8), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]]), torch.rand(5, 2)
with torch.no_grad():
    y = m(x, idx, w)
for use_engine in (True, False):
    pid = os.fork()
    if pid == 0:
        if use_engine:
            with torch.no_grad():
                sys.exit(0 if torch.equal(m(x, idx, w), y) else 3)
        sys.exit(0)  # through the interpreter's exit, static destructors included
    print(use_engine, child_status(pid))
with torch.no_grad():
    assert torch.equal(m(x, idx, w), y)  # the parent's engine is untouched
# A lock another thread held at the fork (here this one, configuring) is made anew in the child.
with kt_sft._ext._configuring:
    pid = os.fork()
    if pid == 0:
        kt_sft.configure(threads=1)
        os._exit(0)
print("configure", child_status(pid))
""")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["True", "0", "False", "0", "configure", "0"]


def test_a_call_in_flight_at_a_fork_fails_in_the_child_with_what_to_do():
    ran = run_script(WAIT_FOR_CHILD + LONG_CALLS + """
call = queued_call()
pid = os.fork()
if pid == 0:
    try:
        call.wait()
        os._exit(4)
    except RuntimeError as e:
        os._exit(0 if "before the process forked" in str(e) and call.done() else 5)
print(child_status(pid))
call.wait()  # the parent's call finishes as usual
""")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["0"]


def test_the_interpreter_exits_cleanly_with_calls_queued_or_running():
    # Calls queued on the driver while the interpreter exits: the runtime's static destructor freed the scratch
    # under the running call (a segfault in 3 of 3 runs).
    queued = run_script(LONG_CALLS + """
import threading, time
ready = threading.Event()
def hold():
    calls = [queued_call() for _ in range(3)]  # never waited for
    ready.set()
    time.sleep(1000)
threading.Thread(target=hold, daemon=True).start()
ready.wait()
""")
    assert queued.returncode == 0 and not queued.stderr, queued.stderr
    # A daemon thread still in engine calls after ops/at_exit.py's wait: coming back to Python during the
    # shutdown ends that thread by unwinding it, which a noexcept frame had turned into std::terminate (SIGABRT).
    running = run_script(LONG_CALLS + """
import threading
started = threading.Event()
def loop():
    while True:
        queued_call().wait()
        started.set()
threading.Thread(target=loop, daemon=True).start()
started.wait()
""")
    assert running.returncode == 0, running.stderr
    # Calls dropped without a wait (an exception between a call's start and its wait): the drop waits for the call,
    # and had given the GIL back and taken it again in a destructor, which aborted during the shutdown.
    dropped = run_script(LONG_CALLS + """
import threading
started = threading.Event()
def loop():
    while True:
        queued_call()
        started.set()
threading.Thread(target=loop, daemon=True).start()
started.wait()
""")
    assert dropped.returncode == 0, dropped.stderr


def test_the_interpreter_exits_cleanly_while_a_daemon_thread_runs_a_model():
    # As `llamafactory-cli chat` left on a generation cut off by Ctrl-C: the thread outlived ops/at_exit.py's wait and
    # was stopped inside torch's ops (SIGABRT or SIGSEGV in 14 of 18 runs); it now ends at its next experts call.
    done = run_script("""
import sys, threading, torch
sys.path.insert(0, %r)
from tiny_models import tiny_model
from kt_sft.models import use_cpu_experts
model = tiny_model("qwen3_moe")
use_cpu_experts(model)
ids = torch.randint(0, 96, (4, 48))
started = threading.Event()
def loop():
    while True:
        model(input_ids=ids, labels=ids).loss.backward()
        started.set()
for _ in range(2):
    threading.Thread(target=loop, daemon=True).start()
started.wait()
""" % os.path.join(os.path.dirname(__file__), "..", "models"))
    assert done.returncode == 0, done.stderr


def test_configure_keeps_the_pin_setting_asked_for():
    # configure() fills in what it is not given from the current settings; pinning had been read from whether the
    # pool got pinned, which is False while threads outnumber CPUs, so the setting was lost.
    before = kt_sft.capabilities()
    cpus = len(os.sched_getaffinity(0))
    try:
        kt_sft.configure(threads=cpus + 1, pin=True)
        assert not kt_sft.capabilities()["pinned"] and kt_sft.capabilities()["pin"]
        kt_sft.configure(threads=cpus)
        assert kt_sft.capabilities()["pin"]
        assert kt_sft.capabilities()["pinned"] == before["pinned"]
    finally:
        kt_sft.configure(threads=before["threads"], pin=before["pin"])
