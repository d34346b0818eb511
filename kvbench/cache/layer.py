"""Per-layer KV storage on transformers' Cache API.

A :class:`KVLayer` is one transformer layer's cache. Subclasses say how tokens are stored
(:meth:`append`), which tensors they hold (:meth:`held_tensors`) and how the stored tokens are
attended: :meth:`stored` hands them out as block sources (:mod:`kvbench.cache.source`) that
read the packed storage a block at a time; :meth:`read`, the whole store reconstructed, is the
reference those sources are tested against and the fallback of a layer without sources.

Read rule (DESIGN.md, "Real storage, honest bits"): the tokens of the current forward are attended
in the full precision the model just computed; everything stored by earlier forwards is read from
storage. In prefill this means attention uses the exact keys and values and only what is kept is
quantized; in decode the new token sees itself exactly and every earlier token through the cache.
This is also KIVI's order (attend, then push the new token into the residual and quantize).

Decode path: :meth:`KVLayer.update` takes the layer's sources *before* appending this forward's
tokens (sources are views of storage that appends never overwrite), appends, and returns only the
forward's own tokens; :meth:`KVLayer.attend` then runs blockwise attention over the sources plus the
exact tokens, merging blocks with an online softmax. No full-precision copy of the cache is made:
the transient memory of a step is O(block), and an append is O(new tokens) (doubling buffers,
:mod:`kvbench.cache.growable`). With nothing stored yet (a prefill) the exact tokens go to SDPA.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache.blockwise import LogitObserver, blockwise_attention_forward
from kvbench.cache.masks import newest_causal_mask
from kvbench.cache.source import ConcatSource, TokenSource
from kvbench.kernels.cpu.parts import read_kernels


@dataclass
class StoredTokens:
    """What a layer has stored, ready to attend: ``keys``/``values`` sources of T entries and, when
    a kv head's entries are not in sequence order, their positions (``[B, H_kv, T]`` int64, -1 for
    an entry never attended; see :func:`~kvbench.cache.blockwise.blockwise_attention`), or, for
    entries in order whose last k replace k earlier ones, ``replaced`` (``[B, H_kv, k]``; see
    :func:`~kvbench.cache.blockwise.single_call_attention`). ``hidden``: a static layer's sources
    cover its stores' whole capacity; bool ``[T]`` on the device, True at entries not written
    (:mod:`kvbench.cache.static`)."""

    keys: TokenSource
    values: TokenSource
    positions: torch.Tensor | None = None
    replaced: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return self.keys.num_tokens


def concat_stored(parts: list[StoredTokens | None], lengths: list[int] | None = None) -> StoredTokens | None:
    """Parts one after the other (a sink, then a method's store). ``lengths``: the sequence length
    each part covers, needed only when some part carries positions (later parts' positions are
    shifted by the earlier lengths; a part without positions holds its tokens in order). None when
    every part is empty."""
    keep = [(i, p) for i, p in enumerate(parts) if p is not None and p.num_entries]
    if not keep:
        return None
    if any(p.replaced is not None for _, p in keep):
        raise ValueError("concat_stored takes parts without replaced entries")
    if len(keep) == 1 and keep[0][1].positions is None:
        return keep[0][1]
    keys = ConcatSource([p.keys for _, p in keep])
    values = ConcatSource([p.values for _, p in keep])
    with_pos = [p.positions for _, p in keep if p.positions is not None]
    if not with_pos:
        return StoredTokens(keys, values)
    if lengths is None:
        raise ValueError("concat_stored needs the parts' sequence lengths when positions are involved")
    b, h = with_pos[0].shape[:2]
    device = with_pos[0].device
    offsets = [sum(lengths[:i]) for i in range(len(parts))]
    pos = []
    for i, p in keep:
        own = p.positions
        if own is None:
            own = torch.arange(p.num_entries, device=device).expand(b, h, p.num_entries)
        pos.append(torch.where(own >= 0, own + offsets[i], own))
    return StoredTokens(keys, values, torch.cat(pos, dim=-1))


class KVLayer(CacheLayerMixin):
    """Base class of kvbench cache layers. Keys arrive post-RoPE as ``[B, H_kv, T, D]``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    # Who reads the stored tokens in decode steps (the method's ``backend``; Method.build_layers
    # sets it): :func:`~kvbench.kernels.cpu.parts.read_kernels` picks the reader from it (compiled
    # CPU kernels, Triton, or the torch reference).
    read_backend = "auto"

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_tokens = 0
        self._pending: StoredTokens | None = None  # what update() took for attend()
        self.static = False  # reserve(): the graph-capturable step of kvbench.cache.static

    @property
    def stored_for_attention(self) -> StoredTokens | None:
        """What the latest :meth:`update` took from storage for the :meth:`attend` that follows it
        (None: nothing stored before that forward, or a layer whose attend reads its stores its own
        way). The layer's half of the contract in :mod:`kvbench.cache.cache`."""
        return self._pending

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

    def reference_tokens(self) -> int:
        """Tokens the FP16 reference holds for this layer: what transformers' own cache would keep
        (every token, :attr:`num_tokens`; a sliding-window layer keeps only its window). The memory
        report's ``n_values`` counts these."""
        return self.num_tokens

    def read_stats(self) -> tuple[int, int]:
        """(payload bits read, stored values that could have been read) by decode queries, for
        methods that read less than they store (ReadKV); others read everything: (0, 0)."""
        return 0, 0

    def read_traffic(self) -> tuple[int, int] | None:
        """``(decode reads, bytes moved)`` so far, for methods whose reads move less than they
        store (ReadKV: the bytes its prefix reads move); None for methods that read everything."""
        return None

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

    def stored(self) -> StoredTokens | None:
        """Everything stored, as block sources, or None when this layer has none (then
        :meth:`update` reconstructs the cache with :meth:`read`, the slow path). Called before this
        forward's tokens are appended; the sources must keep reading the same entries afterwards
        (views of storage that appends never overwrite)."""
        return None

    def bytes_reserved(self) -> int:
        """Bytes allocated for this layer's storage, spare capacity of its doubling buffers
        included. Reported beside the held bytes, never in them. Default: what it holds."""
        return sum(t.numel() * t.element_size() for ts in self.held_tensors().values() for t in ts)

    # -- static mode (kvbench.cache.static) -----------------------------------------------------
    def static_stores(self) -> tuple:
        """The two stores a static layer reserves and advances, keys' and values' (each with
        ``reserve``, ``advance`` and ``static_source``, in token order, holding the same tokens). A
        layer without a static step raises: its method's config refuses ``method.cuda_graph``
        before a model loads (:meth:`~kvbench.methods.base.MethodConfig.static_step_refusal`), so
        this is a guard."""
        raise NotImplementedError(f"{type(self).__name__} has no static (graph-capturable) decode step")

    def reserve(self, capacity: int) -> None:
        """Preallocate for ``capacity`` tokens with device-side lengths, before the first update."""
        if self.num_tokens:
            raise ValueError("reserve() must come before the first update")
        for store in self.static_stores():
            store.reserve(capacity)
        self.static = True

    def step_kind(self) -> tuple:
        """What the next one-token static step does, where that varies (KIVI's flush every R
        steps), as known on the host: one captured graph per kind. Default: one kind."""
        return ()

    def advance(self, t: int) -> None:
        """Count the ``t`` tokens the latest forward (eager, captured or replayed) stored."""
        for store in self.static_stores():
            store.advance(t)
        self.num_tokens += t

    def static_stored(self) -> StoredTokens | None:
        """The two stores' whole capacity as sources, the entries not written before this forward's
        hidden (computed now: this forward's append moves the device counts on)."""
        keys_store, values_store = self.static_stores()
        keys, values = keys_store.static_source(), values_store.static_source()
        if keys is None or values is None:
            return None
        source, written = keys
        hidden = torch.arange(source.num_tokens, device=written.device) >= written
        return StoredTokens(source, values[0], hidden=hidden)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.static:
            # nothing here may read a host count that changes per step (the count moves on
            # advance()): a CUDA graph captured over this replays the next step
            self._pending = self.static_stored() if self.num_tokens else None
            self.append(key_states, value_states)
            return key_states, value_states
        self._pending = self.stored() if self.num_tokens else None
        if self.num_tokens and self._pending is None:
            # no sources: the reference path, the whole cache reconstructed
            past_k, past_v = self.read()
            keys = torch.cat([past_k.to(key_states.dtype), key_states], dim=-2)
            values = torch.cat([past_v.to(value_states.dtype), value_states], dim=-2)
        else:
            keys, values = key_states, value_states
        self.append(key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return keys, values

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        """Attention for this layer. ``keys``/``values`` are what :meth:`update` returned: this
        forward's tokens when the stored ones were taken as sources (then they are attended blockwise
        from storage), else everything. Methods that choose what to attend (outlier pools, top-k
        prefetch, query-adaptive reads, score tracking) override this."""
        stored, self._pending = getattr(self, "_pending", None), None
        if stored is None:
            q, kv = query.shape[-2], keys.shape[-2]
            if attention_mask is None and 1 < q < kv:
                attention_mask = newest_causal_mask(q, kv, query.device)
            return sdpa_attention_forward(module, query, keys, values, attention_mask, **kwargs)
        return self.attend_stored(module, query, stored, keys, values, attention_mask, **kwargs)

    def attend_stored(
        self,
        module,
        query: torch.Tensor,
        stored: StoredTokens,
        keys: torch.Tensor,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None,
        observer: LogitObserver | None = None,
        **kwargs,
    ):
        """Blockwise attention of ``query [B, H, q, D]`` over ``stored`` and the exact ``keys``/``values``
        ``[B, H_kv, q, D]`` of this forward; returns ``(out [B, q, H, D], None)``."""
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise ValueError(
                "kvbench attention over stored tokens supports neither softcap nor attention sinks"
            )
        return blockwise_attention_forward(
            module,
            query,
            stored.keys,
            stored.values,
            attention_mask,
            scaling=kwargs.get("scaling"),
            exact_keys=keys,
            exact_values=values,
            positions=stored.positions,
            observer=observer,
            replaced=stored.replaced,
            hidden=stored.hidden,
            reader=read_kernels(self.read_backend, query.device),
        )

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
