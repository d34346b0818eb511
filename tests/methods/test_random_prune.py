"""random_prune draws its scores where the keys are, with a generator of that device seeded from
(seed, layer): on the CPU exactly the draw of before (the golden outputs hold), on a CUDA device a
different but equally seeded one, with no host-built tensor copied over.

Without a GPU, the device routing is checked with the keys' device stood in for (the generator and
the draw are recorded, not run); the ``-m cuda`` test runs the real thing on a device.
"""

from types import SimpleNamespace

import pytest
import torch

from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=4)


def prune_layer(layer_idx=0, seed=0, batch=1):
    method = build_method({"name": "random_prune", "budget": 50, "window": 10, "seed": seed})
    cache = method.new_cache(SHAPE, torch.float32)
    layer = cache.layers[layer_idx]
    layer.update(torch.zeros(batch, 2, 1, 4), torch.zeros(batch, 2, 1, 4))  # sizes the layer
    return layer


@pytest.mark.parametrize(("seed", "layer_idx", "batch"), [(0, 0, 1), (3, 2, 1), (7, 1, 2)])
def test_cpu_scores_are_the_draw_of_before(seed, layer_idx, batch):
    layer = prune_layer(layer_idx, seed, batch)
    keys = torch.zeros(batch, 2, 200, 4)
    got = layer.candidate_scores(None, keys, None, 1.0, 190)
    # the former code: a default (CPU) generator, a host draw, then .to(device)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    want = torch.rand(batch, 2, 190, generator=gen)
    assert got.device == keys.device and torch.equal(got, want)


def test_scores_are_drawn_on_the_keys_device(monkeypatch):
    """With keys on a CUDA device (stood in for: only their ``.device`` is read), the generator is
    that device's and the draw is made there: no host tensor, no copy."""
    cuda = torch.device("cuda", 1)
    made, drawn = [], []
    real_rand = torch.rand

    class Generator:
        def __init__(self, device=None):
            made.append(torch.device(device) if device is not None else torch.device("cpu"))
            self.seed = None

        def manual_seed(self, seed):
            self.seed = seed
            return self

    def rand(*size, generator=None, device=None, **kwargs):
        drawn.append((size, generator, torch.device(device) if device is not None else None))
        return real_rand(*size)  # a stand-in for the device's draw

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch, "rand", rand)
    layer = prune_layer(layer_idx=2, seed=5)
    scores = layer.candidate_scores(None, SimpleNamespace(device=cuda), None, 1.0, 30)
    assert made == [cuda]
    ((size, generator, device),) = drawn
    assert size == (1, 2, 30) and device == cuda
    assert isinstance(generator, Generator) and generator.seed == 5 * 1_000_003 + 2
    assert scores.shape == (1, 2, 30)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scores_are_seeded_and_made_on_the_device():
    layer = prune_layer(layer_idx=1, seed=4)
    keys = torch.zeros(1, 2, 200, 4, device="cuda")
    a = layer.candidate_scores(None, keys, None, 1.0, 190)
    b = layer.candidate_scores(None, keys, None, 1.0, 190)
    assert a.device.type == "cuda" and torch.equal(a, b)  # seeded: the same draw every time
    cpu = layer.candidate_scores(None, keys.cpu(), None, 1.0, 190)
    assert not torch.equal(a.cpu(), cpu)  # documented: CUDA's generator draws a different selection
