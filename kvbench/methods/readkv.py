"""``readkv``: ReadKV (Amazon / UC Berkeley, "ReadKV": separate budgets for retained bits and bits
read per query; query-adaptive reads of a progressive KV cache).

Retained: every key and value is stored once as a B-bit affine code (``bits``, default 8; the
paper's headline reads 4 bits on average from an 8-bit cache) in KIVI's layout: keys per channel
over groups of G consecutive tokens, values per token over groups of G channels, z = min,
s = (max - min) / (2^B - 1), round half up (:mod:`kvbench.quant.affine`). The code is progressive
(:mod:`kvbench.quant.progressive`): its top p bits reconstruct at the centre of their bin,
x_p = z + s * ((q >> (B-p) + 0.5) * 2^(B-p) - 0.5), and x_B is the stored value exactly. Stored
entries never change.

Storage layout: the codes are held as bit planes (:class:`~kvbench.cache.bitplanes.BitPlaneTokens`,
:mod:`kvbench.quant.bitplanes`), plane j holding bit B-1-j of every code, 8 entries per byte: keys'
planes packed along tokens (a key prefix is per channel, so channel c's first p_c planes are
p_c * T / 8 bytes), values' along channels (a value prefix is per token: token t's first p_t planes
are p_t * D / 8 bytes); plus fp16 scales/zeros. B bits per stored entry, as packed B-bit codes.

What "read bits" means, two counters:

- the paper's *logical payload read* (``read_bits_total``): a value read at prefix p counts p bits
  (the codes' top p bits) for every query head; scales/zeros and the full-precision tokens are not
  counted;
- the bytes a prefix reader of this layout moves per decode step (``read_bytes_total``, over
  ``read_steps`` steps): per (sequence, kv head), the planes any query head sharing it needs
  (key plane j of channel c when some head reads p_c > j: T / 8 bytes; value plane j of token t
  when some head reads p_t > j: ceil(D / 8) bytes), plus every scale and zero (a prefix of 0 bits
  still reconstructs at the group's centre) and the full-precision tokens. With one query head per
  kv head and no GQA this is the logical count in bytes plus the parameters; a GQA group reads the
  union of its heads' prefixes.

The torch read below assembles, per block of tokens and per kv head, the codes from only the
planes some query row sharing the head reads (:meth:`PlaneStore.read_codes`: bit B-1-j of key
channel c only if some row's p_c > j, of value token t only if some row's p_t > j; the other bits
stay 0), then reconstructs each row's prefixes at their bin centres
(:func:`~kvbench.quant.progressive.prefix_reconstruct`), so it computes exactly what the dense
reference computes from the full codes. As plain torch it still loads each plane's bytes of the
block before masking them; the counter above is what a reader that skips the unneeded planes
moves, and the tests flip every bit of the unneeded planes to check that the output does not move.
On the CPU (backend ``auto``) the read is three compiled calls instead (allocation, key scores,
value mix: :func:`compiled_query_adaptive_attention`, ``kvbench/kernels/cpu/planes.cpp``) that load
only the planes a row's prefix needs, so a read of p bits per entry moves about p bits.

With ``backend=triton`` the same three calls are Triton kernels (:mod:`kvbench.kernels.triton_planes`,
the CUDA path; the CPU interpreter in tests), and so is every other read of the stored planes: a
forward of more than two tokens over stored tokens (a continuation fed in chunks) goes through them
with every prefix at B bits, which is the stored reconstruction the other backends read blockwise
(:class:`~kvbench.cache.bitplanes.PlaneSource`), so no part of the planes is read by torch. Around
the kernels stay torch: the softmax, the exact (full-precision) tokens' two matmuls, and the appends
(quantizing and cutting codes into planes: the Triton append of :mod:`kvbench.kernels.quant_pack`
packs whole codes, not bit planes; the stored bytes are the same on every backend). A full read
holds the logits ``[B, H_kv, rep * q, T]`` of the chunk at once, where the blockwise path holds a
block. ``sink_tokens`` is refused on triton: behind a sink the layer's own reads are not used
(:mod:`kvbench.cache.sink`) and the generic blockwise attention would read the planes.

Streaming: new tokens join a full-precision buffer (``fp_dtype``); whenever it holds at least
R + G tokens (R = ``residual``, default 0, as the paper's abstract names no window), its oldest G
tokens, keys and values together, are quantized. So the newest R..R+G-1 tokens stay exact.

Reads, per decode query (query length 1-2; every query head and position is its own query; the
abstract's two stages, each optimal under a fixed budget with diminishing refinement gains):

1. Keys. The key part of the budget is ``floor(2 * key_share * read_bits * D)`` bits per stored
   token, split over channels: channel c gets p_c in 0..B bits (the same for every stored token)
   minimising sum_c (|q_c| sigma_c)^2 4^(-p_c), sigma_c the root-mean-square key scale of channel c
   over its token groups: the variance of the score error q . (k_p - k). Greedy over refinement
   gains (:func:`~kvbench.quant.progressive.allocate_prefix_bits`) is exact here.
2. Attention a = softmax(q K_p^T * scaling + mask) over the reconstructed stored keys, the exact
   buffered tokens and this forward's tokens (one softmax).
3. Values. The value part, ``floor(2 * (1 - key_share) * read_bits * T)`` bits per channel, i.e.
   ``(1 - key_share) * 2 * read_bits`` bits per value on average, is split over stored tokens:
   token t gets p_t in 0..B bits minimising sum_t (a_t rho_t)^2 4^(-p_t), rho_t the RMS of the
   token's value scales over its channel groups (the variance of the output error a . (V_p - V)).
4. Output = a . [V_p; exact tokens].

With ``read_bits = bits`` and ``key_share = 0.5`` every prefix is full, and the output is dense
attention over the stored reconstruction. Prefill (and chunks longer than two tokens) uses the
normal path: exact tokens of this forward, stored tokens at full B-bit reconstruction.

Accounting: ``held_tensors`` holds codes, scales, zeros and the ``residual`` buffer (retained bits).
Read bits are counted separately on the layer: ``read_bits_total`` (payload bits read) and
``read_values_total`` (stored values each query could read, keys and values), and
:meth:`ReadKVLayer.read_bits_per_value` is their ratio (None before any query-adaptive read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from kvbench.cache.bitplanes import BitPlaneTokens
from kvbench.cache.blockwise import configured_block_size
from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import cat_tokens
from kvbench.cache.masks import grouped_additive_mask
from kvbench.config import require
from kvbench.kernels.cpu import note_backend
from kvbench.kernels.cpu.parts import CompiledReader, read_kernels
from kvbench.methods.affine_base import FullPrecisionWindow
from kvbench.methods.base import Method, MethodConfig, check_group, register_method
from kvbench.quant.progressive import allocate_prefix_bits, prefix_reconstruct


@dataclass
class ReadKVConfig(FullPrecisionWindow, MethodConfig):
    """``bits``: stored code width B (integer 2..8). ``read_bits``: mean payload bits read per value
    per query (0 < read_bits <= bits; null: min(4, bits)). ``key_share``: fraction of the read
    budget spent on keys."""

    name: str = "readkv"
    read_bits: float | None = None
    group_size: int = 32
    residual: int = 0
    key_share: float = 0.5

    # auto: the compiled plane kernels on the CPU where they built (kvbench/kernels/cpu/planes.cpp);
    # triton: every read of the stored planes through kvbench/kernels/triton_planes.py (appends and
    # the full-precision tokens in torch)
    backends: ClassVar[tuple[str, ...]] = ("torch", "triton")
    # 2: codes stored as bit planes (same values and attention, other bytes)
    version: ClassVar[int] = 2
    default_bits: ClassVar[float] = 8.0
    # the query-adaptive reads: 30 s against 8 s per window in attention_probe's CPU records
    cost_cpu: ClassVar[float] = 3.5
    bits_knob: ClassVar[str | None] = "read_bits"  # the run's bits set the read budget, not B

    def __post_init__(self):
        super().__post_init__()
        require(
            self.bits is not None and float(self.bits).is_integer() and 2 <= self.bits <= 8,
            "method.bits",
            self.bits,
            "the stored code width: an integer from 2 to 8",
        )
        if self.read_bits is None:
            self.read_bits = min(4.0, self.bits)
        require(
            0 < self.read_bits <= self.bits,
            "method.read_bits",
            self.read_bits,
            f"mean bits read per value: a number in (0, method.bits={self.bits:g}]",
        )
        self.read_bits = float(self.read_bits)
        require(
            self.group_size > 0 and self.group_size % 8 == 0,
            "method.group_size",
            self.group_size,
            "a positive multiple of 8 (tokens per key group, channels per value group; key planes "
            "pack 8 tokens per byte)",
        )
        require(
            self.residual >= 0,
            "method.residual",
            self.residual,
            "a non-negative integer: newest tokens kept in full precision",
        )
        require(
            0 <= self.key_share <= 1,
            "method.key_share",
            self.key_share,
            "the fraction of the read budget spent on keys, in [0, 1]",
        )
        require(
            self.backend != "triton" or not self.sink_tokens,
            "method.sink_tokens",
            self.sink_tokens,
            "0 with method.backend=triton: behind a sink the planes are read by the generic blockwise "
            "attention, which the Triton plane kernels do not serve",
        )

    def check_model(self, shape):
        check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")


class Codes(NamedTuple):
    """Unpacked stored codes ``[B, H_kv, T, D]`` (uint8) with scale/zero expanded to that shape
    (float32), and ``rms``, the root-mean-square scale the allocation weighs by: per channel
    ``[B, H_kv, D]`` for keys, per token ``[B, H_kv, T]`` for values."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    rms: torch.Tensor


def grouped_codes(codes, scale, zero, axis: str, group: int) -> Codes:
    """:class:`Codes` from unpacked codes and the grouped ``scale``/``zero`` of
    :func:`~kvbench.quant.affine.quantize_grouped` (``axis`` ``channel``: keys, ``token``: values)."""
    dim = -2 if axis == "channel" else -1
    scale = scale.float()
    rms = scale.pow(2).mean(dim).sqrt()
    return Codes(codes, scale.repeat_interleave(group, dim), zero.float().repeat_interleave(group, dim), rms)


def budgets(read_bits: float, key_share: float, head_dim: int, tokens: int) -> tuple[int, int]:
    """``(key bits per stored token, value bits per channel)``: the integer read budgets of the two
    stages (module docstring, steps 1 and 3)."""
    key = math.floor(2 * key_share * read_bits * head_dim + 1e-9)
    value = math.floor(2 * (1 - key_share) * read_bits * tokens + 1e-9)
    return key, value


def stored_and_exact_weights(
    stored: list[torch.Tensor],
    query: torch.Tensor,
    exact_k: torch.Tensor | None,
    scaling: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Step 2's attention ``[B, H_kv, n, T + t]``: one softmax over the stored tokens' scaled logits
    (``stored``, blocks in token order) followed by the exact tokens' ``query . exact_k``, plus the
    additive ``mask``; a row that sees nothing gets weights 0."""
    if exact_k is not None and exact_k.shape[-2]:
        stored = [*stored, query @ exact_k.float().transpose(-1, -2) * scaling]
    logits = stored[0] if len(stored) == 1 else torch.cat(stored, dim=-1)
    if mask is not None:
        logits = logits + mask
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(logits - top)
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def query_adaptive_attention(
    query: torch.Tensor,
    keys: Codes,
    values: Codes,
    bits: int,
    key_budget: int,
    value_budget: int,
    scaling: float,
    exact_k: torch.Tensor | None = None,
    exact_v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ReadKV's read for queries ``[B, H_kv, n, D]`` (n query rows per kv head) over stored codes
    ``[B, H_kv, T, D]`` followed by exact tokens ``[B, H_kv, t, D]`` (or None); ``mask`` is additive
    ``[B, H_kv, n, T + t]`` (or None). Returns float32 ``(out [B, H_kv, n, D], key prefix bits
    [B, H_kv, n, D], value prefix bits [B, H_kv, n, T])``."""
    q = query.float()
    tq = keys.codes.shape[-2]
    # 1. key channels: weight |q_c| * sigma_c
    pk = allocate_prefix_bits(q.abs() * keys.rms[:, :, None, :], bits, key_budget)  # [B, H, n, D]
    k_p = prefix_reconstruct(
        keys.codes[:, :, None], keys.scale[:, :, None], keys.zero[:, :, None], bits, pk[:, :, :, None, :]
    )  # [B, H, n, T, D]
    # 2. attention over reconstructed stored keys and exact tokens, one softmax
    logits = (k_p @ q[..., None])[..., 0] * scaling  # [B, H, n, T]
    a = stored_and_exact_weights([logits], q, exact_k, scaling, mask)
    a_stored = a[..., :tq]
    # 3. value tokens: weight a_t * rho_t
    pv = allocate_prefix_bits(a_stored * values.rms[:, :, None, :], bits, value_budget)  # [B, H, n, T]
    v_p = prefix_reconstruct(
        values.codes[:, :, None], values.scale[:, :, None], values.zero[:, :, None], bits, pv[..., None]
    )  # [B, H, n, T, D]
    # 4. output
    out = (a_stored[..., None, :] @ v_p)[..., 0, :]
    if exact_v is not None and exact_v.shape[-2]:
        out = out + a[..., tq:] @ exact_v.float()
    return out, pk, pv


class PlaneStore(NamedTuple):
    """A store's bit planes and grouped ``scale``/``zero`` as held (views taken before a forward
    appends), with its code width, group size, quantization axis and plane packing."""

    planes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    axis: str
    along: str
    head_dim: int

    @classmethod
    def of(cls, store: BitPlaneTokens) -> PlaneStore:
        return cls(
            store.planes, store.scale, store.zero, store.bits, store.group_size, store.axis, store.along,
            store.head_dim,
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return self.planes.shape[-2] * (8 if self.along == "token" else 1)

    def params(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 scale and zero expanded to ``[B, H_kv, stop - start, D]`` for tokens
        ``[start, stop)`` (group-aligned for the channel axis)."""
        if self.axis == "channel":
            rows = slice(start // self.group, stop // self.group)
            s = self.scale[..., rows, :].float().repeat_interleave(self.group, -2)
            z = self.zero[..., rows, :].float().repeat_interleave(self.group, -2)
        else:
            s = self.scale[..., start:stop, :].float().repeat_interleave(self.group, -1)
            z = self.zero[..., start:stop, :].float().repeat_interleave(self.group, -1)
        return s, z

    def read_codes(self, need: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The codes of tokens ``[start, stop)`` as far as the planes ``need`` asks for: uint8
        ``[B, H_kv, stop - start, D]`` holding bit B-1-j of an entry only where ``need > j`` (0
        elsewhere), built from those planes' bits and nothing else. ``need`` is the longest prefix
        any query row sharing the kv head reads: ``[B, H_kv, D]`` per channel for token-packed key
        planes (start/stop multiples of 8), ``[B, H_kv, stop - start]`` per token for
        channel-packed value planes."""
        b, h = self.planes.shape[:2]
        d, bits = self.head_dim, self.bits
        lanes = torch.arange(8, dtype=torch.uint8, device=self.planes.device)
        if self.along == "token":
            o = (stop - start) // 8
            planes = self.planes[..., start // 8 : stop // 8, :].view(b, h, o, bits, d)
            out = torch.zeros(b, h, o, d, 8, dtype=torch.uint8, device=planes.device)
            for j in range(bits):
                keep = ((need > j).to(torch.uint8) << (bits - 1 - j))[:, :, None, :, None]  # [B, H, 1, D, 1]
                out |= ((planes[:, :, :, j, :, None] >> lanes) & 1) * keep
            return out.transpose(-1, -2).reshape(b, h, o * 8, d)
        t, d8 = stop - start, -(-d // 8)
        planes = self.planes[..., start:stop, :].view(b, h, t, bits, d8)
        out = torch.zeros(b, h, t, d8 * 8, dtype=torch.uint8, device=planes.device)
        for j in range(bits):
            keep = ((need > j).to(torch.uint8) << (bits - 1 - j))[..., None]  # [B, H, T, 1]
            out |= ((planes[:, :, :, j, :, None] >> lanes) & 1).reshape(b, h, t, d8 * 8) * keep
        return out[..., :d]


def blockwise_query_adaptive_attention(
    query: torch.Tensor,
    keys: PlaneStore,
    values: PlaneStore,
    bits: int,
    key_budget: int,
    value_budget: int,
    scaling: float,
    exact_k: torch.Tensor | None = None,
    exact_v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    block_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`query_adaptive_attention` read from the bit planes, a block of tokens at a time: each
    kv head's codes are assembled from the planes its query rows read (:meth:`PlaneStore.read_codes`)
    and each row's prefixes reconstructed at their bin centres, ``[B, H_kv, n, block, D]`` for one
    block only. Two passes, because step 3's allocation needs the attention of every stored token:
    pass 1 computes the logits of all stored tokens (``[B, H_kv, n, T]``), pass 2 the prefix-read
    values. Same arguments and results as the dense function (the same prefix reconstructions),
    up to float reassociation."""
    q = query.float()
    tq = keys.num_tokens
    block = max(keys.group, block_size // keys.group * keys.group)  # whole key groups per block
    ranges = [(s, min(s + block, tq)) for s in range(0, tq, block)]
    # 1. key channels: weight |q_c| * sigma_c (sigma: RMS of the channel's scales over its groups)
    rms_k = keys.scale.float().pow(2).mean(-2).sqrt()  # [B, H, D]
    pk = allocate_prefix_bits(q.abs() * rms_k[:, :, None, :], bits, key_budget)  # [B, H, n, D]
    key_need = pk.amax(2)  # [B, H, D]: the planes some query row sharing the kv head reads
    # 2. logits of the stored tokens, block by block, then one softmax with the exact tokens
    parts = []
    for start, stop in ranges:
        s, z = keys.params(start, stop)
        codes = keys.read_codes(key_need, start, stop)  # [B, H, block, D]
        k_p = prefix_reconstruct(codes[:, :, None], s[:, :, None], z[:, :, None], bits, pk[:, :, :, None, :])
        parts.append((k_p @ q[..., None])[..., 0] * scaling)  # [B, H, n, block]
    a = stored_and_exact_weights(parts, q, exact_k, scaling, mask)
    a_stored = a[..., :tq]
    # 3. value tokens: weight a_t * rho_t (rho: RMS of the token's scales over its channel groups)
    rho_v = values.scale.float().pow(2).mean(-1).sqrt()  # [B, H, T]
    pv = allocate_prefix_bits(a_stored * rho_v[:, :, None, :], bits, value_budget)  # [B, H, n, T]
    value_need = pv.amax(2)  # [B, H, T]
    # 4. output, block by block
    out = None
    for start, stop in ranges:
        s, z = values.params(start, stop)
        prefix = pv[..., start:stop]
        codes = values.read_codes(value_need[..., start:stop], start, stop)  # [B, H, block, D]
        v_p = prefix_reconstruct(codes[:, :, None], s[:, :, None], z[:, :, None], bits, prefix[..., None])
        part = (a_stored[..., None, start:stop] @ v_p)[..., 0, :]
        out = part if out is None else out + part
    if exact_v is not None and exact_v.shape[-2]:
        out = out + a[..., tq:] @ exact_v.float()
    return out, pk, pv


def compiled_query_adaptive_attention(
    kernels,
    query: torch.Tensor,
    keys: PlaneStore,
    values: PlaneStore,
    bits: int,
    key_budget: int,
    value_budget: int,
    scaling: float,
    exact_k: torch.Tensor | None = None,
    exact_v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "compiled",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`blockwise_query_adaptive_attention` through the compiled CPU kernels
    (``kvbench/kernels/cpu/planes.cpp``) or their Triton twins
    (:class:`~kvbench.kernels.triton_planes.TritonPlanes`, ``backend="triton"``): the allocation,
    the key scores and the value mix are one call each over the whole store, reading only the
    planes some row's prefix needs, so the ops of a read do not grow with the context. Same results
    up to float reassociation, and to the order in which gains tied at the budget's threshold are
    taken (lowest item first here). ``backend`` is what the run records as the reader."""
    q = query.float().contiguous()
    tq = keys.num_tokens
    rms_k = kernels.plane_rms(keys.scale, -2)  # [B, H, D]
    pk = kernels.allocate_prefix(q.abs() * rms_k[:, :, None, :], bits, key_budget)
    logits = kernels.plane_key_scores(q, keys.planes, keys.scale, keys.zero, pk, bits, keys.group, scaling)
    a = stored_and_exact_weights([logits], q, exact_k, scaling, mask)
    a_stored = a[..., :tq]
    rho_v = kernels.plane_rms(values.scale, -1)  # [B, H, T]
    pv = kernels.allocate_prefix(a_stored * rho_v[:, :, None, :], bits, value_budget)
    out = kernels.plane_value_mix(
        a_stored, values.planes, values.scale, values.zero, pv, bits, values.group, values.head_dim
    )
    if exact_v is not None and exact_v.shape[-2]:
        out = out + a[..., tq:] @ exact_v.float()
    note_backend(backend)
    return out, pk, pv


def planes_moved(keys: PlaneStore, values: PlaneStore, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
    """Code bytes a prefix reader of the planes moves for one read (module docstring), as a device
    int64 scalar: per (sequence, kv head) the planes some query head needs, key plane j of channel c
    (``T / 8`` bytes) when any head's ``pk > j``, value plane j of token t (``ceil(D / 8)``) when
    any head's ``pv > j``. ``pk [B, H_kv, n, D]``, ``pv [B, H_kv, n, T]``."""
    planes = torch.arange(keys.bits, device=pk.device)[:, None]
    key_planes = (pk.amax(2)[..., None, :] > planes).sum()  # (plane, channel) pairs
    value_planes = (pv.amax(2)[..., None, :] > planes).sum()  # (plane, token) pairs
    return key_planes * (keys.num_tokens // 8) + value_planes * -(-values.head_dim // 8)


class ReadKVLayer(CompositeLayer):
    def __init__(self, layer_idx, cfg: ReadKVConfig, fp_dtype):
        super().__init__(layer_idx)
        self.bits = int(cfg.bits)
        self.read_bits, self.key_share = cfg.read_bits, cfg.key_share
        self.group, self.residual = cfg.group_size, cfg.residual
        self.kq = BitPlaneTokens(self.bits, "channel", self.group)
        self.vq = BitPlaneTokens(self.bits, "token", self.group)
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)
        self.read_bits_total = 0
        self.read_values_total = 0
        # bytes moved by the decode reads: planes (a device tensor, so no step waits on the device)
        # plus parameters and full-precision tokens (known on the host)
        self.read_steps = 0
        self.read_bytes_host = 0
        self.read_bytes_planes: torch.Tensor | None = None
        # (key store, value store, buffer k, buffer v, new k, new v, whether every prefix is full)
        self._adaptive: tuple | None = None

    def append(self, keys, values):
        self.k_res.append(keys)
        self.v_res.append(values)
        while len(self.k_res) >= self.residual + self.group:
            self.kq.append(self.k_res.pop_front(self.group))
            self.vq.append(self.v_res.pop_front(self.group))

    def update(self, key_states, value_states, *args, **kwargs):
        self._adaptive = None
        full = key_states.shape[-2] > 2  # not a decode query: read the stored tokens in full
        if len(self.kq) and (not full or self.read_backend == "triton"):
            # views of storage that appends never overwrite: they stay valid after the append
            self._adaptive = (
                PlaneStore.of(self.kq),
                PlaneStore.of(self.vq),
                self.k_res.data,
                self.v_res.data,
                key_states,
                value_states,
                full,
            )
        return super().update(key_states, value_states, *args, **kwargs)

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        adaptive, self._adaptive = self._adaptive, None
        if adaptive is None or kwargs.get("softcap") is not None:
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        self._pending = None
        kc, vc, k_buf, v_buf, new_k, new_v, full = adaptive
        b, h, q_len, d = query.shape
        hk = new_k.shape[1]
        rep = h // hk
        qf = query.float().reshape(b, hk, rep * q_len, d)  # query heads kv*rep + r share kv head kv
        exact_k, exact_v = cat_tokens(k_buf, new_k), cat_tokens(v_buf, new_v)
        tq = kc.num_tokens
        kv_len = tq + exact_k.shape[-2]
        mask = grouped_additive_mask(attention_mask, b, hk, rep, q_len, kv_len, query.device)
        # a full read (longer queries, backend triton only) is every prefix at B bits: the stored
        # B-bit reconstruction, as the blockwise path reads it
        kb, vb = (d * self.bits, tq * self.bits) if full else budgets(self.read_bits, self.key_share, d, tq)
        scaling = kwargs.get("scaling") or module.scaling
        reader = read_kernels(self.read_backend, query.device)
        # a reader that is not the compiled one is Triton's (triton, or auto on a CUDA device with
        # triton): its planes have their own kernels
        if reader is not None and not isinstance(reader, CompiledReader):
            from kvbench.kernels.triton_planes import triton_planes  # imports triton

            out, pk, pv = compiled_query_adaptive_attention(
                triton_planes(), qf, kc, vc, self.bits, kb, vb, scaling, exact_k, exact_v, mask, "triton"
            )
            if full:
                return out.reshape(b, h, q_len, d).transpose(1, 2).contiguous().to(query.dtype), None
        elif isinstance(reader, CompiledReader):
            out, pk, pv = compiled_query_adaptive_attention(
                reader.k, qf, kc, vc, self.bits, kb, vb, scaling, exact_k, exact_v, mask
            )
        else:
            out, pk, pv = blockwise_query_adaptive_attention(
                qf, kc, vc, self.bits, kb, vb, scaling, exact_k, exact_v, mask, configured_block_size()
            )
        # every row of pk / pv spends exactly min(budget, items * bits) bits
        # (allocate_prefix_bits), so the tally is known on the host: summing the allocations
        # would make the host wait for the device at every layer of every step
        rows = pk.shape[0] * pk.shape[1] * pk.shape[2]
        key_bits = max(0, min(int(kb), d * self.bits))
        value_bits = max(0, min(int(vb), tq * self.bits))
        self.read_bits_total += rows * (key_bits * tq + value_bits * d)
        self.read_values_total += 2 * rows * tq * d
        moved = planes_moved(kc, vc, pk, pv)
        self.read_bytes_planes = moved if self.read_bytes_planes is None else self.read_bytes_planes + moved
        self.read_bytes_host += sum(
            x.numel() * x.element_size()
            for x in (kc.scale, kc.zero, vc.scale, vc.zero, k_buf, v_buf)
            if x is not None
        )
        self.read_steps += 1
        out = out.reshape(b, h, q_len, d)
        return out.transpose(1, 2).contiguous().to(query.dtype), None

    def read_bits_per_value(self) -> float | None:
        """Mean payload bits read per stored value per query, over this layer's decode reads."""
        return self.read_bits_total / self.read_values_total if self.read_values_total else None

    def read_stats(self):
        return self.read_bits_total, self.read_values_total

    def read_traffic(self):
        if not self.read_steps:
            return None
        return self.read_steps, int(self.read_bytes_planes) + self.read_bytes_host


@register_method("readkv")
class ReadKV(Method):
    fp16_prefill = True
    arm_batch = True
    Config = ReadKVConfig
    # 6 stored bits: 8 + fp16 params (1 bit at G = 32) would not fit the contract's < FP16/2 check
    contract_node = {"bits": 6, "read_bits": 3}
    contract_error = 0.2
    Layer = ReadKVLayer

    def base_label(self) -> str:
        c = self.config
        return f"readkv-{c.read_bits:g}of{c.bits:g}b"
