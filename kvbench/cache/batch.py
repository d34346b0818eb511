"""Batched decoding over per-sequence storage: B sequences, ragged or not, through one model forward,
each stored and attended exactly as it is when it runs alone (batch 1).

Design (the path recorded as :data:`PER_SEQUENCE`): a :class:`SequenceBatchCache` holds one cache
per sequence, each built by the method exactly as for batch 1 (``runner.new_cache()``), so every
layer of sequence i is the method's own batch-1 storage. The model runs one forward over the
left-padded batch ``[B, T_max]``; in every layer

- :meth:`SequenceBatchCache.update` hands sequence i only its real tokens: its row of the keys and
  values ``[1, H_kv, t_i, D]``, the left pads dropped (the pad counts come from the attention mask
  at prefill, :meth:`SequenceBatchCache.set_padding`), so a pad never enters a sequence's codes,
  scales, residual window, eviction scores, top-k candidates or read allocations, and each
  sequence's group boundaries (KIVI's G-token key groups, SemKV's chunks, ...) fall where they
  fall alone;
- attention (:meth:`_SequenceAttention.attend`) runs per sequence over that sequence's own layer,
  with its own query rows ``[1, H, t_i, D]`` and no mask (the plain causal rule of an unpadded
  forward, which is what the layer gets alone); the pad query rows come out as zeros, and the
  model's outputs at those rows are never read.

Positions are each sequence's own (the runner's ``position_ids`` are ``cumsum(mask) - 1``, as
transformers' ``generate`` builds them), so post-RoPE keys equal the alone run's. The batch-wide
sizes transformers asks the cache for (``get_seq_length``, ``get_mask_sizes``) are those of the
padded batch, so the 2-D attention mask and the model's mask arguments line up; the masks built
from them are not read by the per-sequence attention.

Why not the native batched storage (one ``[B, H_kv, T, D]`` store per layer) for an unpadded batch
of equal lengths: not every method is per-row with it. Measured on the tiny Llama of
tests/test_batched_decode.py (3 distinct prompts of 30 tokens, 8 greedy tokens, native cache
against each prompt alone): ``random_prune`` draws one ``[B, H_kv, n]`` score tensor from a
generator seeded per (seed, layer), so rows past the first keep other tokens than alone (rows 2
and 3 diverged); uncalibrated ``kvquant`` diverged on row 3; the other twelve matched there, but
that is one setting, not a proof (budgets, allocators and outlier counts are per-tensor
quantities in several stores). So every batch takes the per-sequence path, which is exact by
construction: the method code that runs for sequence i is the batch-1 code on sequence i's
tensors. What is batched is
everything outside attention (embeddings, projections, MLPs, the LM head), the bulk of a decode
step's FLOPs at short and moderate context; the attention calls are B per layer.

Outputs equal the alone run's up to the float rounding of batched matrix products: a decode step's
``[R, K] x [K, N]`` projections sum in another order than batch 1's ``[1, K]`` ones (the CPU's BLAS
takes a matrix-vector kernel for one row). Measured on the default model (4 ragged prompts of
800-1024 tokens, 12 greedy steps, each prompt prefilled alone, ``ModelRunner.generate_batch``): the
first token's logits are bitwise the alone run's, the decode steps' logits move by up to 6e-3
(fp16) and 8e-3 (KIVI-2) over the 12 steps, on logits of magnitude 10-30, with the same tokens and
the same bytes stored; a padded batched prefill (``prefill="batch"``) moves the first token's
logits as well. A task's batched rows therefore differ from its batch-1
rows in their last digits: its ``batch_size`` is part of the run's config (and id), and each row
records the batch it ran in. A method's discrete
decisions can amplify such a last-bit difference: a value at a rounding boundary takes the
neighbouring code, two near-tied scores swap in a top-k (SemKV on the tiny Qwen2: same tokens and
bytes, logits 4e-2 apart after a decode chunk's allocation). Tokens and storage sizes are
unaffected unless the decision is itself a near-tie of the greedy choice.

Finished sequences leave the batch (:meth:`SequenceBatchCache.keep`): later forwards carry only
the rows still decoding, so a finished sequence's storage stays exactly as it was when it stopped,
as alone.

Not supported (clear errors): models with sliding-window layers (their window masks are not
replayed per sequence), a first forward that does not cover the whole padded prompts (chunked
prefill), right padding or holes in the mask, empty prompts.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache.cache import KVBenchCache, check_handed_to_attention
from kvbench.cache.masks import newest_causal_mask

# The name of the batched path, recorded in generations and benchmark rows.
PER_SEQUENCE = "per_sequence"


def sequence_caches(cache: KVBenchCache) -> list[KVBenchCache]:
    """The per-sequence caches the next forward over ``cache`` feeds, row by row: those of a
    :class:`SequenceBatchCache`'s current rows, or ``[cache]`` for a batch-1 cache. A method that
    keeps per-request state on its cache (SpeCache's speculative token) keeps it on these."""
    if isinstance(cache, SequenceBatchCache):
        return [cache.sequences[s] for s in cache.rows]
    return [cache]


class _BatchLayer(CacheLayerMixin):
    """What transformers sees of one layer of a :class:`SequenceBatchCache`: the padded batch's
    length (every row's pads plus its stored tokens, which is the same for every row). Storage
    lives in the per-sequence caches."""

    is_sliding = False

    def __init__(self, owner: SequenceBatchCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.owner.padded_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.padded_length() + query_length, 0

    def padded_length(self) -> int:
        return self.owner.padded_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        raise NotImplementedError("kvbench caches are built fresh for every request; reset is not supported")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("kvbench caches do not support beam search")


class _SequenceAttention:
    """One layer's attention over a batch: each row attends its own sequence's layer."""

    def __init__(self, layer_idx: int, parts: list[tuple[KVBenchCache, int, torch.Tensor, torch.Tensor]]):
        self.layer_idx, self.parts = layer_idx, parts

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        """``query [R, H, q, D]`` of the padded batch; returns ``(out [R, q, H, D], None)``, row r's
        pad positions zero. ``attention_mask`` (the padded batch's) is not read: each sequence
        attends its real tokens under the plain causal rule, as alone."""
        rows, _, q, head_dim = query.shape
        out = None
        position_ids = kwargs.pop("position_ids", None)
        for r, (sub, start, k, v) in enumerate(self.parts):
            own = dict(kwargs)
            if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
                own["position_ids"] = position_ids[min(r, position_ids.shape[0] - 1) : r + 1, start:]
            q_r = query[r : r + 1, :, start:].contiguous()
            layer = sub.layer_to_attend(self.layer_idx, k)
            if layer is None:  # a model that reads other keys than update returned: plain SDPA
                n = q_r.shape[-2]
                mask = newest_causal_mask(n, k.shape[-2], q_r.device) if n > 1 else None
                o, _ = sdpa_attention_forward(module, q_r, k, v, mask, **own)
            else:
                o, _ = layer.attend(module, q_r, k, v, None, **own)
            if out is None:
                out = o.new_zeros(rows, q, o.shape[-2], o.shape[-1])
            out[r, start:] = o[0]
        return out, None


class SequenceBatchCache(KVBenchCache):
    """A batch of sequences, each in its own cache of the method (see the module docstring).

    ``caches``: one fresh cache per sequence, from the method (``runner.new_cache()``), in batch
    order. :meth:`set_padding` must be called with the left-padded batch's 2-D attention mask before
    the first forward."""

    path = PER_SEQUENCE

    def __init__(self, caches: list[KVBenchCache]):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        n_layers = {len(c.layers) for c in caches}
        if len(n_layers) != 1:
            raise ValueError(f"the sequences' caches have different layer counts: {sorted(n_layers)}")
        for c in caches:
            if not isinstance(c, KVBenchCache):
                raise TypeError(f"per-sequence caches must be kvbench caches, got {type(c).__name__}")
            sliding = [i for i, layer in enumerate(c.layers) if getattr(layer, "is_sliding", False)]
            if sliding:
                raise NotImplementedError(
                    f"batched decoding over sliding-window layers (layers {sliding}) is not supported: "
                    "decode one sequence at a time"
                )
        self._count = n_layers.pop()
        super().__init__([_BatchLayer(self, i) for i in range(self._count)])
        self.sequences = list(caches)
        self.pads: list[int] | None = None
        self.rows: list[int] = list(range(len(caches)))  # sequence of each batch row
        self._attending: dict[int, _SequenceAttention] = {}

    # -- the batch ------------------------------------------------------------------------------
    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Learn each sequence's left-pad count from the prefill's 2-D ``attention_mask [B, T_max]``
        (1 at real tokens). Refuses right padding, holes and empty rows."""
        mask = attention_mask.detach().to("cpu", torch.long)
        if mask.dim() != 2 or mask.shape[0] != len(self.sequences):
            raise ValueError(
                f"attention_mask must be [B={len(self.sequences)}, T], got {tuple(attention_mask.shape)}"
            )
        if any(self.padded_length(i) for i in range(self._count)):
            raise RuntimeError("set_padding goes before the first forward")
        real = mask.sum(dim=1)
        pads = mask.shape[1] - real
        want = torch.arange(mask.shape[1])[None, :] >= pads[:, None]
        if not torch.equal(mask.bool(), want) or bool((real == 0).any()):
            raise ValueError(
                "batched decoding takes left-padded prompts of at least one token each "
                "(attention_mask 0...0 1...1 per row)"
            )
        self.pads = pads.tolist()

    def adopt_prefilled(self, lengths: list[int]) -> None:
        """Join sequences that were each prefilled alone (sequence i's cache holds ``lengths[i]``
        tokens): every row is left-padded to the longest, as though the prefill had been one padded
        forward, so the decode steps that follow move all rows in one column. Instead of
        :meth:`set_padding`."""
        if len(lengths) != len(self.sequences) or any(n < 1 for n in lengths):
            raise ValueError(f"one prompt length >= 1 per sequence ({len(self.sequences)}), got {lengths}")
        held = [c.get_seq_length() for c in self.sequences]
        if held != list(lengths):
            raise RuntimeError(f"the sequences' caches hold {held} tokens, not the prompt lengths {lengths}")
        longest = max(lengths)
        self.pads = [longest - n for n in lengths]

    def keep(self, sequences: list[int]) -> None:
        """The next forwards carry these sequences, in this order (finished ones dropped)."""
        if not sequences or any(not 0 <= s < len(self.sequences) for s in sequences):
            raise ValueError(f"sequences to keep must be indices into the batch, got {sequences}")
        self.rows = list(sequences)

    def padded_length(self, layer_idx: int = 0) -> int:
        """Tokens of the padded batch that layer ``layer_idx`` has seen: 0 before the prefill, then
        each row's pads plus what its sequence stored (the same for every row: they move in step)."""
        if self.pads is None:
            return 0
        lengths = set()
        for s in self.rows:
            stored = self.sequences[s].layers[layer_idx].get_seq_length()
            lengths.add(self.pads[s] + stored if stored else 0)
        if len(lengths) != 1:
            raise RuntimeError(f"the sequences are out of step in layer {layer_idx}: {sorted(lengths)}")
        return lengths.pop()

    def starts(self, query_length: int, layer_idx: int = 0) -> list[int]:
        """For each row of a forward of ``query_length`` tokens, the column its real tokens start at
        (its pads in a prefill, 0 afterwards)."""
        if self.pads is None:
            raise RuntimeError("call set_padding with the prefill's attention mask before the first forward")
        seen = self.padded_length(layer_idx)
        starts = [max(0, self.pads[s] - seen) for s in self.rows]
        if any(start >= query_length for start in starts):
            raise NotImplementedError(
                "a batched forward must give every row at least one real token: prefill the padded "
                "prompts in one forward (chunked prefill is not supported)"
            )
        return starts

    def attention_mask(self, query_length: int, device=None) -> torch.Tensor:
        """long ``[R, padded + q]`` for the next forward of the current rows: 0 at each row's pads."""
        total = self.padded_length() + query_length
        pads = torch.tensor([self.pads[s] for s in self.rows])
        mask = (torch.arange(total)[None, :] >= pads[:, None]).long()
        return mask if device is None else mask.to(device)

    # -- transformers' Cache / the attention contract ----------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_handed_to_attention(self, kwargs)
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"the forward has {key_states.shape[0]} rows, the batch {len(self.rows)}")
        starts = self.starts(key_states.shape[-2], layer_idx)
        parts = []
        for r, (s, start) in enumerate(zip(self.rows, starts, strict=True)):
            sub = self.sequences[s]
            k, v = sub.update(
                key_states[r : r + 1, :, start:].contiguous(),
                value_states[r : r + 1, :, start:].contiguous(),
                layer_idx,
            )
            parts.append((sub, start, k, v))
        self._attending[layer_idx] = _SequenceAttention(layer_idx, parts)
        self._returned[layer_idx] = key_states
        return key_states, value_states

    def layer_to_attend(self, layer_idx: int | None, keys: torch.Tensor) -> Any:
        """The per-sequence attention of the latest :meth:`update` of ``layer_idx`` (an object with
        the layer's ``attend``), once. An attention call that reads other keys than that update
        returned (a model that shares or recomputes keys) is refused: plain SDPA over the padded
        batch would attend the pads."""
        returned = self._returned.pop(layer_idx, None) if layer_idx is not None else None
        attending = self._attending.pop(layer_idx, None) if layer_idx is not None else None
        if returned is None or returned is not keys or attending is None:
            raise NotImplementedError(
                f"batched decoding: the attention of layer {layer_idx} reads other keys than its cache "
                "update returned (shared or recomputed keys), which the per-sequence path cannot attend"
            )
        return attending
