"""One prefill per prompt, shared by every method whose prefill is the FP16 one.

Prefill follows the papers (DESIGN.md): attention inside the prefill forward uses the keys and values
just computed, in full precision, and only what is stored is quantized. So for every method that
declares it (:meth:`kvbench.methods.Method.prefill_is_fp16`) the prefill forward is the same
computation whatever the method: the same hidden states, the same logits, the same keys and values
handed to the cache. What differs is only what each cache makes of them. A node whose arms run the
same prompts (9-28 methods over one set of windows) therefore needs the model's forward once per
prompt; each further arm only stores.

How:

- :func:`~kvbench.cache.recorder.record_prefill` opens a recorder for one forward over one cache.
  While it is open, :meth:`kvbench.cache.KVBenchCache.update` records each layer's input keys and
  values ``[1, H_kv, T, D]`` (and the update's keywords), and the attention function
  (:func:`kvbench.cache.attention.kvbench_attention`) the layer's query ``[1, H, T, D]``, mask and
  keywords. Copies are kept, so nothing a cache does to its inputs later reaches the record.
- :func:`replay_prefill` hands a :class:`PrefillRecord` to another cache of any method, layer by
  layer, through the same two calls the forward makes: ``cache.update(keys, values, layer_idx,
  kwargs=...)`` then, where the layer overrides :meth:`~kvbench.cache.layer.KVLayer.attend` (eviction
  scores, SnapKV's observation window, pools chosen by attention), the layer's ``attend`` on the
  recorded query. The attention output is dropped: it is the recorded forward's. The cache ends up
  holding what its own prefill would have stored, byte for byte (``tests/cache/test_prefill.py``
  checks the digests of every method that declares it).
- :data:`SHARED_PREFILLS` keeps the records of one process by (model, prompt tokens), and the
  attention captures of the instruments (the attention probe's), within a byte
  budget (``KVBENCH_PREFILL_STORE_GB``, default a sixth of the machine's memory; 0 switches sharing
  off). A full store keeps what it holds and takes nothing new: a node runs its arms one after
  another over the same samples in the same order, so keeping the first samples serves every later
  arm, where evicting the oldest would miss every time.

What is recorded is the forward of the first arm that runs the prompt, through its own cache: its
logits are its own prefill's. That equals every other declaring method's prefill only because the
declaration is true; a method that computes its prefill attention itself (H2O, in float32) or reads
more of the forward than the cache calls (SemKV's hidden-state and logit metrics) does not declare
it and always prefills itself.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from kvbench.cache.cache import ATTENTION_KWARG
from kvbench.cache.layer import KVLayer
from kvbench.cache.recorder import PrefillRecord, record_prefill

ENV_BUDGET = "KVBENCH_PREFILL_STORE_GB"

__all__ = ["SHARED_PREFILLS", "PrefillStore", "record_prefill", "replay_prefill", "token_digest"]


def _attend_observes(layer) -> bool:
    """Whether ``layer``'s attend does more than plain attention over a prefill's own tokens (it
    overrides :meth:`KVLayer.attend`), so that a replay must call it."""
    return type(layer).attend is not KVLayer.attend


@torch.no_grad()
def replay_prefill(cache, record: PrefillRecord) -> None:
    """Store ``record`` in ``cache`` (empty, of any method) as its own prefill forward would have."""
    for idx in range(len(cache.layers)):
        part = record.layers[idx]
        update_kwargs = dict(part.update_kwargs)
        inner = dict(update_kwargs.get("kwargs") or {})
        inner[ATTENTION_KWARG] = cache
        update_kwargs["kwargs"] = inner
        keys, values = cache.update(part.keys, part.values, idx, **update_kwargs)
        layer = cache.layer_to_attend(idx, keys)
        if layer is None:
            continue
        if _attend_observes(layer):
            layer.attend(part.module, part.query, keys, values, part.mask, **part.attention_kwargs)
        else:
            layer._pending = None  # what plain attend does first; the output is the recorded one


def token_digest(input_ids) -> str:
    """A digest of token ids (a tensor or a list), for a store key."""
    ids = torch.as_tensor(input_ids).detach().to("cpu", torch.int64).contiguous()
    return f"{tuple(ids.shape)}:" + hashlib.sha256(ids.numpy().tobytes()).hexdigest()


class PrefillStore:
    """What one process computed from a model's forward over a prompt, kept for the next request of
    the same prompt, by ``(what, prompt digest, ...)`` keys, within ``budget`` bytes (see the module
    docstring): :class:`PrefillRecord` s of the runner's prefill, and the attention captures of the
    instruments (:func:`kvbench.tasks.attention_probe.capture_window`). A value says its size by
    ``nbytes``. ``hits``/``misses``/``refused`` count lookups and values too large to keep. One
    model at a time: asking about another model drops what was kept."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self.records: OrderedDict[tuple, Any] = OrderedDict()
        self.held = 0
        self.hits = self.misses = self.refused = 0
        self._model: weakref.ref | None = None

    @property
    def budget(self) -> int:
        """Bytes it may hold (None at construction: :func:`default_budget`, read on first use)."""
        if self._budget is None:
            self._budget = default_budget()
        return self._budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self._budget = value
        self.clear()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def _check_model(self, model) -> None:
        current = None if self._model is None else self._model()
        if current is not model:
            self.clear()
            self._model = weakref.ref(model)

    def get(self, model, key: tuple) -> Any:
        self._check_model(model)
        value = self.records.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, model, key: tuple, value: Any) -> bool:
        """Keep ``value`` unless that would pass the budget (a full store keeps what it holds)."""
        self._check_model(model)
        if key in self.records:
            return True
        size = value.nbytes
        if self.held + size > self.budget:
            self.refused += 1
            return False
        self.records[key] = value
        self.held += size
        return True

    def clear(self) -> None:
        self.records.clear()
        self.held = 0


def default_budget() -> int:
    """Bytes the process may hold in shared prefills: ``KVBENCH_PREFILL_STORE_GB`` (GiB; 0 turns
    sharing off), else a sixth of the machine's physical memory."""
    raw = os.environ.get(ENV_BUDGET)
    if raw not in (None, ""):
        try:
            gb = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_BUDGET}={raw!r}: a number of GiB (0 switches sharing off)") from None
        if gb < 0:
            raise ValueError(f"{ENV_BUDGET}={raw!r}: a number of GiB >= 0 (0 switches sharing off)")
        return int(gb * 2**30)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return total // 6


SHARED_PREFILLS = PrefillStore()
