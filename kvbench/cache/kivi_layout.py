"""KIVI's storage layout (Liu et al., ICML 2024, Sec. 3.2, Algorithm 1), shared by every method that
stores affine codes in it (KIVI, SpeCache's low-bit copy, OTT).

- keys per channel: statistics per channel over groups of G consecutive tokens;
- values per token: statistics per token over groups of ``value_group_size`` channels (KIVI: G);
- a full-precision residual of up to R tokens (R a multiple of G).

Streaming rules, for l tokens arriving at once (prefill) or one at a time (decode):

- keys: new keys join the key residual X_Kr; whenever it holds at least R tokens, the oldest
  ``floor(|X_Kr| / R) * R`` are quantized and appended to Q(X_Kg). In prefill this is KIVI's
  r = l mod R split (X_Kg = X_K[:l-r], X_Kr = X_K[l-r:]); in decode the residual fills to R and is
  flushed whole.
- values: new values join the value queue X_Vr; while it holds more than R tokens, the oldest are
  quantized per token and appended to Q(X_Vg), so the newest R values stay in full precision.

With ``backend=triton``, decode steps (one or two new tokens) attend through the fused kernel,
which reads the packed codes directly; a step with a mask (padding), which that kernel does not
take, reads the same parts through the Triton part reader
(:class:`~kvbench.kernels.triton_parts.TritonReader`). The read rule is unchanged: stored tokens
as they were before this forward, new tokens exact.
"""

from __future__ import annotations

import torch

from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.kivi_static import KIVIStatic, ring_attention
from kvbench.cache.layer import cat_tokens, merge_held
from kvbench.cache.quantized import QuantizedTokens
from kvbench.kernels.runtime import gpu_reads_levels
from kvbench.quant.affine import zero_point_for
from kvbench.quant.attention_ref import PackedKV


class KIVILayer(CompositeLayer):
    """``key_levels``/``value_levels``: level counts; ``group_size``: tokens per key group;
    ``value_group``: channels per value group (KIVI: ``group_size``; None: the whole head);
    ``zero_point``: the user's choice, resolved per level count
    (:func:`~kvbench.quant.affine.zero_point_for`); ``arithmetic``: how the affine map is computed
    (:data:`~kvbench.quant.affine.ARITHMETICS`: kvbench's ``fp32`` or KIVI's released ``kivi``)."""

    def __init__(
        self,
        layer_idx: int,
        key_levels: int,
        value_levels: int,
        group_size: int,
        value_group: int | None,
        residual: int,
        zero_point: str,
        fp_dtype: torch.dtype,
        backend: str = "torch",
        arithmetic: str = "fp32",
    ):
        super().__init__(layer_idx)
        self.backend = backend
        self._before: tuple | None = None  # the stores before this forward's append (fused path)
        self.group, self.residual = group_size, residual
        zk, zv = zero_point_for(zero_point, key_levels), zero_point_for(zero_point, value_levels)
        self.kq = QuantizedTokens(
            key_levels, "channel", group_size, zk, backend=backend, arithmetic=arithmetic
        )
        self.vq = QuantizedTokens(
            value_levels, "token", value_group, zv, backend=backend, arithmetic=arithmetic
        )
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)
        self._ring: KIVIStatic | None = None  # static mode (kvbench.cache.kivi_static)
        self._snapshot: tuple | None = None  # static mode: what this forward's attention reads

    # -- static mode (kvbench.cache.kivi_static): rings and device counts ---------------------------
    def reserve(self, capacity: int) -> None:
        if self.num_tokens:
            raise ValueError("reserve() must come before the first update")
        self._ring = KIVIStatic(self, capacity)
        self.static = True

    def advance(self, t: int) -> None:
        self._ring.advance(t)
        self.num_tokens += t

    def step_kind(self):
        return self._ring.step_kind() if self._ring is not None else ()

    def held_tensors(self):
        if self._ring is None:
            return super().held_tensors()
        return merge_held(self.kq.held_tensors(), self.vq.held_tensors(), self._ring.held())

    def bytes_reserved(self) -> int:
        if self._ring is None:
            return super().bytes_reserved()
        return self.kq.bytes_reserved() + self.vq.bytes_reserved() + self._ring.bytes_reserved()

    def append(self, keys, values):
        self.k_res.append(keys)
        flush = len(self.k_res) // self.residual * self.residual
        if flush:
            self.kq.append(self.k_res.pop_front(flush))
        self.v_res.append(values)
        if len(self.v_res) > self.residual:
            self.vq.append(self.v_res.pop_front(len(self.v_res) - self.residual))

    # Whether decode steps on backend triton take the fused kernel, which reads exactly the four
    # parts above; a subclass that stores more (OTT's outlier pools) sets False and reads every part
    # through the layer's part reader instead.
    fused_decode = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self._ring is not None:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self._snapshot = self._ring.snapshot() if self.num_tokens else None
            self._pending = None
            self._ring.append(key_states, value_states)
            return key_states, value_states
        fused = (
            self.fused_decode
            and self.backend == "triton"
            and gpu_reads_levels(self.kq.levels, key_states.device)
            and gpu_reads_levels(self.vq.levels, key_states.device)
        )
        if not fused or key_states.shape[-2] > 2 or not self.num_tokens:
            self._before = None
            return super().update(key_states, value_states, *args, **kwargs)
        # Views of storage that appends never overwrite: these references stay valid. The parts
        # as sources too, for a step with a mask (padding), which the kernel does not take: it then
        # reads them through the part reader (TritonReader) instead.
        self._pending = self.stored()
        self._before = (
            PackedKV.from_store(self.kq),
            self.k_res.data,
            PackedKV.from_store(self.vq),
            self.v_res.data,
        )
        self.append(key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return key_states, value_states

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        if self._snapshot is not None:
            snapshot, self._snapshot = self._snapshot, None
            if attention_mask is not None or query.shape[-2] != 1:
                raise ValueError("a static KIVI step takes one unpadded query token")
            from kvbench.kernels.cpu.parts import read_kernels

            scaling = kwargs.get("scaling") or module.scaling
            reader = read_kernels(self.read_backend, query.device)
            out = ring_attention(query, snapshot, self.residual, scaling, keys, values, reader)
            return out.transpose(1, 2).contiguous().to(query.dtype), None
        if self._before is None:
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        kq, k_res, vq, v_res = self._before
        self._before = None
        if attention_mask is not None:
            # padding or an explicit mask: the kernel only knows the causal rule of the newest
            # tokens, so the parts taken in update() are read with the mask by the part reader
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        self._pending = None
        from kvbench.kernels.cpu import note_backend
        from kvbench.kernels.decode_attention import fused_decode_attention

        note_backend("triton")
        scaling = kwargs.get("scaling") or module.scaling
        out = fused_decode_attention(
            query,
            kq,
            vq,
            scaling,
            key_residual=cat_tokens(k_res, keys),
            value_residual=cat_tokens(v_res, values),
        )
        return out.transpose(1, 2).contiguous(), None
