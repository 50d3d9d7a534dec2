"""The buffers a training forward saves for backward come from a pool that survives changing batch lengths
(csrc/moe/saved_pool.h): a shorter batch reuses a longer one's buffers, and a longer one does not make the
pool drop everything, since with gradient checkpointing's kept passes every layer holds its buffers at once."""
from experts_case import Shape, inputs, make_module, run_engine

from kt_sft._ext import _C


def step(m, T):
    shape = Shape("pool", T=T, H=32, I=1531, E=4, K=2, r=4)  # an I no other test uses: its own buffer sizes
    run_engine(m, *inputs(shape))
    return _C.saved_pool_allocations()


def test_shorter_and_returning_batches_reuse_the_pool():
    m = make_module(Shape("pool", T=64, H=32, I=1531, E=4, K=2, r=4), lora=True)
    m.train()
    _C.saved_pool_release()  # what earlier tests left would serve some requests
    after_64 = step(m, 64)
    assert step(m, 40) == after_64, "a shorter batch allocated instead of reusing a longer one's buffers"
    after_100 = step(m, 100)
    assert after_100 > after_64
    assert step(m, 64) == after_100, "the pool dropped the longer batch's buffers"
