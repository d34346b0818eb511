"""SpeCache's offload of new tokens to the host store (:class:`kvbench.methods.specache.HostTokens`).

With CUDA, every layer's new keys and values go to the pinned host store on a side stream without
blocking, and the next reader of the store (the gather of the next forward's prefetch, or a growth
of the buffer) first waits on the copy's event. On the CPU the copies stay plain and no stream or
event is made. What the CPU can check: that the CPU path touches no CUDA stream or event, and the
wait protocol (a pending event is waited on before every host read of the buffer, once). That the
copies overlap the step on a GPU, and land correctly, only the ``-m cuda`` test here shows (not run
on a CPU-only machine; it is not among the pytests scripts/gpu_check.sh runs on the lent device).
"""

from types import SimpleNamespace

import pytest
import torch

from kvbench.methods import ModelShape, build_method
from kvbench.methods.specache import PRE_DECODE, SPECULATIVE_STEP, HostTokens


def specache_layer(head_dim=8, **overrides):
    node = {"name": "specache", "bits": 2, "group_size": 2, "residual": 2, "topk": 3, **overrides}
    method = build_method(node)
    method.config.check_model(ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim))
    return method.make_layer(0, None, torch.float32)


def attend(layer, query, keys, values):
    out, _ = layer.attend(SimpleNamespace(scaling=1.0), query, keys, values, None, scaling=1.0)
    return out


class FakeEvent:
    """Stands in for a pending ``torch.cuda.Event``: counts how often the host waits on it."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_cpu_decode_makes_no_stream_or_event(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path must not touch CUDA streams or events")

    for name in ("Stream", "Event", "stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    torch.manual_seed(0)
    layer = specache_layer()
    k, v = torch.randn(2, 1, 1, 40, 8).unbind(0)
    layer.update(k[:, :, :30], v[:, :, :30])
    layer.plan = PRE_DECODE
    keys, values = layer.update(k[:, :, 30:31], v[:, :, 30:31])
    attend(layer, torch.randn(1, 2, 1, 8), keys, values)
    for i in range(30, 38):  # speculative steps: each stores one token and prefetches for the next
        layer.plan = SPECULATIVE_STEP
        keys, values = layer.update(k[:, :, i : i + 2], v[:, :, i : i + 2])
        attend(layer, torch.randn(1, 2, 2, 8), keys, values)
    assert layer.num_tokens == 38 and layer.fetches == 9
    assert layer.host_k.copied is None and layer.host_v.copied is None
    assert torch.equal(layer.host_k.buf[:, :, :38], k[:, :, :38].half())
    assert torch.equal(layer.host_v.buf[:, :, :38], v[:, :, :38].half())


def test_a_pending_copy_is_waited_on_before_the_host_reads_the_store():
    store = HostTokens(torch.float16)
    x = torch.randn(1, 2, 5, 4)
    store.append(x)
    pending = FakeEvent()
    store.copied = pending  # as a CUDA append leaves it
    rows = store.gather(torch.tensor([[[4, 0], [1, 2]]]))
    assert pending.waited == 1 and store.copied is None
    assert torch.equal(rows[0, 0], x[0, 0, [4, 0]].half()) and torch.equal(rows[0, 1], x[0, 1, [1, 2]].half())
    store.gather(torch.tensor([[[0], [0]]]))
    assert pending.waited == 1  # waited once


def test_growing_the_store_waits_for_the_pending_copy_first():
    store = HostTokens(torch.float16)
    store.append(torch.randn(1, 1, 3, 4))
    pending = FakeEvent()
    store.copied = pending
    store.append(torch.randn(1, 1, 1, 4))  # past the exact prompt: the buffer grows, old rows move
    assert pending.waited == 1 and store.copied is None
    pending = FakeEvent()
    store.copied = pending
    store.append(torch.randn(1, 1, 1, 4))  # room left: no host read, no wait
    assert pending.waited == 0 and store.copied is pending


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_is_asynchronous_and_lands_exactly():
    device = torch.device("cuda")
    store = HostTokens(torch.float16)
    assert store.pin
    chunks = []
    for t in (300, 1, 1, 64, 1):  # the prompt, decode steps, a growth
        # made by a kernel on the current stream just before the append: the side stream must wait
        x = (torch.randn(2, 4, t, 128, device=device) @ torch.eye(128, device=device)) * 3
        store.append(x)
        assert store.copied is not None  # pending, not waited for
        chunks.append(x.half().cpu())
        del x  # its memory may be reused at once: record_stream keeps it until the copy has read it
        torch.randn(2, 4, 512, 128, device=device)  # reuse the freed memory
    assert store.buf.is_pinned()
    store.wait()
    assert torch.equal(store.buf[..., : store.n, :], torch.cat(chunks, dim=2))
    idx = torch.randint(0, store.n, (2, 4, 16))
    want = torch.cat(chunks, dim=2).gather(2, idx[..., None].expand(-1, -1, -1, 128))
    assert torch.equal(store.gather(idx), want)
