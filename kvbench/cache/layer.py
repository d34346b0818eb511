"""Per-layer KV storage on transformers' Cache API.

A :class:`KVLayer` is one transformer layer's cache. Subclasses say how tokens are stored
(:meth:`append`), how they are read back (:meth:`read`) and which tensors they hold
(:meth:`held_tensors`); the base class does the bookkeeping every method shares.

Read rule (DESIGN.md, "Real storage, honest bits"): the tokens of the current forward are attended
in the full precision the model just computed; everything stored by earlier forwards is read from
storage. In prefill this means attention uses the exact keys and values and only what is kept is
quantized; in decode the new token sees itself exactly and every earlier token through the cache.
This is also KIVI's order (attend, then push the new token into the residual and quantize).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class KVLayer(CacheLayerMixin):
    """Base class of kvbench cache layers. Keys arrive post-RoPE as ``[B, H_kv, T, D]``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_tokens = 0

    # -- storage, implemented by each method -------------------------------------------------
    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new tokens ``[B, H_kv, t, D]`` (after they have been attended)."""

    @abstractmethod
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, reconstructed as ``[B, H_kv, num_tokens, D]`` in any float dtype."""

    @abstractmethod
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this layer holds, by accounting component (``codes``, ``scales``, ``zeros``,
        ``residual``, ``fp``, ...). Memory figures are computed from exactly these."""

    def quantized_values(self) -> int:
        """How many key/value elements are held as codes (the denominator of code bits/value)."""
        return 0

    def nominal_code_bits(self) -> float:
        """Sum over quantized elements of log2(levels); divided by :meth:`quantized_values` it is the
        nominal (unpacked) code width."""
        return 0.0

    def read_stats(self) -> tuple[int, int]:
        """(payload bits read, stored values that could have been read) by decode queries, for
        methods that read less than they store (ReadKV); others read everything: (0, 0)."""
        return 0, 0

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this layer keeps in host memory rather than on the accelerator, by accounting
        component (SpeCache's full-precision copy). They are reported as ``host_bytes`` and never
        enter the device figures. Default: none."""
        return {}

    def prefetch_stats(self) -> tuple[int, int, int] | None:
        """``(fetches, entries, bytes)`` moved host -> accelerator so far, for a layer that fetches
        from :meth:`host_tensors` (one fetch per decode forward; an entry is one (token, KV head)
        pair). Default: None, the layer never fetches."""
        return None

    # -- transformers' CacheLayerMixin ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size, self.num_kv_heads, _, self.head_dim = key_states.shape
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.num_tokens:
            past_k, past_v = self.read()
            keys = torch.cat([past_k.to(key_states.dtype), key_states], dim=-2)
            values = torch.cat([past_v.to(value_states.dtype), value_states], dim=-2)
        else:
            keys, values = key_states, value_states
        self.append(key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return keys, values

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        """Attention for this layer. ``keys``/``values`` are what :meth:`update` returned. Methods that
        compute attention over their own storage (outlier pools, top-k prefetch, score tracking)
        override this; the default is transformers' SDPA path."""
        return sdpa_attention_forward(module, query, keys, values, attention_mask, **kwargs)

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("kvbench caches are built fresh for every request; reset is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvbench caches do not support beam search")

    def offload(self):
        # Offloading is a method's own business (SpeCache); transformers' generic mover does not
        # know our tensors.
        pass

    def prefetch(self):
        pass


def cat_tokens(*parts: torch.Tensor | None) -> torch.Tensor:
    """Concatenate ``[B, H_kv, t_i, D]`` parts along tokens, skipping empty ones, in float32
    unless every part shares one dtype."""
    parts = [p for p in parts if p is not None and p.shape[-2] > 0]
    if len({p.dtype for p in parts}) > 1:
        parts = [p.float() for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def merge_held(*held: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Union of several ``held_tensors`` mappings, component by component."""
    merged: dict[str, list[torch.Tensor]] = {}
    for h in held:
        for component, tensors in h.items():
            merged.setdefault(component, []).extend(tensors)
    return merged
