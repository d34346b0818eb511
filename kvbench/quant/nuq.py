"""KVQuant's non-uniform datatype and dense-and-sparse outlier split (Hooper et al., "KVQuant",
NeurIPS 2024, Secs. 3.3-3.4).

Normalization (Sec. 3.3): every vector (a key channel, a value token) is mapped onto [-1, 1] by its
own range ``[lo, hi]`` with ``zero = (hi + lo) / 2``, ``scale = (hi - lo) / 2``:

    y = clamp((x - zero) / scale, -1, 1),      x_hat = c[q] * scale + zero

Datatype: ``q = argmin_i |y - c_i|`` over a codebook of L sorted signposts ``c``. ``nuq``: ``c``
minimizes sum_n (y_n - Q(y_n))^2 over normalized calibration values (the paper's objective with all
Fisher weights F_ii = 1, i.e. unweighted 1-D k-means, solved by Lloyd iterations to a fixed point
where every signpost is the mean of its cell); ``uniform``: ``c_i = -1 + 2 i / (L - 1)`` (the affine
grid on [lo, hi]).

Dense-and-sparse (Sec. 3.4): outliers are kept exactly in a sparse structure and excluded from the
range. Per-channel (keys) the thresholds come from calibration: ``lo_c``/``hi_c`` are the
``f/2`` and ``1 - f/2`` quantiles of channel c, and any element outside ``[lo_c, hi_c]`` is an
outlier. Per-token (values, online) the ``ceil(f * D)`` elements of largest magnitude are outliers
and ``[lo, hi]`` is the min/max of the rest.

The per-channel rule gives each vector as many outliers as the data say. Held as a fixed count per
vector instead (:func:`key_outliers_fixed`: the outlier fraction of Sec. 3.4 as a budget of
``ceil(f * D)`` per vector), their places are known without reading a count back from the device.
"""

from __future__ import annotations

import math

import torch


def outlier_count(n: int, fraction: float) -> int:
    """Outliers kept per vector of ``n`` elements: ``ceil(fraction * n)`` (0 when fraction is 0)."""
    return 0 if fraction <= 0 else min(n, math.ceil(fraction * n - 1e-9))


def topk_outliers(x: torch.Tensor, fraction: float) -> torch.Tensor | None:
    """Channel indices ``[..., k]`` (ascending) of the ``k = outlier_count(D, fraction)``
    largest-magnitude elements of each vector along the last axis, ties at the k-th magnitude going
    to the lowest channel (a stable sort: ``torch.topk`` leaves the choice to its implementation,
    which differs between sizes and backends); None when k is 0. A fixed count per vector, so the
    outliers' places are known without reading the mask back."""
    k = outlier_count(x.shape[-1], fraction)
    if not k:
        return None
    order = x.float().abs().sort(dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def topk_outlier_mask(x: torch.Tensor, fraction: float, idx: torch.Tensor | None = None) -> torch.Tensor:
    """bool mask of the ``outlier_count(D, fraction)`` largest-magnitude elements of each vector
    along the last axis (ties to the lowest channel); ``idx``: their :func:`topk_outliers`,
    when already at hand."""
    mask = torch.zeros_like(x, dtype=torch.bool)
    idx = topk_outliers(x, fraction) if idx is None else idx
    if idx is not None:
        mask.scatter_(-1, idx, True)
    return mask


def masked_range(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` over the last axis ignoring masked elements (float32, keepdim)."""
    x = x.float()
    if mask is None:
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    lo = torch.where(mask, torch.full_like(x, math.inf), x).amin(-1, keepdim=True)
    hi = torch.where(mask, torch.full_like(x, -math.inf), x).amax(-1, keepdim=True)
    # a vector that is all outliers: any finite range
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
    return lo, hi


def channel_thresholds(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel outlier thresholds over the first axis of ``x [N, ...]``: the ``f/2`` and
    ``1 - f/2`` quantiles (min and max when ``f = 0``), float32 of shape ``x.shape[1:]``."""
    x = x.float()
    if fraction <= 0:
        return x.amin(0), x.amax(0)
    flat = x.reshape(x.shape[0], -1)
    q = torch.tensor([fraction / 2, 1 - fraction / 2], dtype=torch.float32, device=x.device)
    lo, hi = tail_quantiles(flat, q)
    return lo.reshape(x.shape[1:]), hi.reshape(x.shape[1:])


def tail_quantiles(flat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``torch.quantile(flat, q, dim=0)`` (linear interpolation), the same bits, for quantiles near
    the ends of ``flat [N, C]``: the order statistics it interpolates between are read from the
    ``k`` smallest and largest of each column (``torch.topk``) instead of a sort of all ``N``. The
    ranks, weights and ``lerp`` are ``torch.quantile``'s, on tensors of its layout (``[C, Q]``), so
    every element takes the path it takes there. Falls back to ``torch.quantile`` when a value is
    not finite (it propagates NaN) or the quantiles reach the middle."""
    n = flat.shape[0]
    ranks = (q.float() * torch.tensor(float(n - 1), device=flat.device)).expand(flat.shape[1], -1)
    below = ranks.long()
    weights = ranks - below
    above = ranks.ceil().long()
    # rows kept from each end: enough for every rank read, from the end nearer to it
    k = max([r + 1 if r < n // 2 else n - r for r in torch.cat([below[0], above[0]]).tolist()] + [1])
    if n == 0 or 4 * k > n or not torch.isfinite(flat).all():
        return torch.quantile(flat, q, dim=0)
    smallest = flat.topk(k, dim=0, largest=False, sorted=True).values  # [k, C], rank r at row r
    largest = flat.topk(k, dim=0, largest=True, sorted=True).values  # rank r at row n - 1 - r

    def at(rank: torch.Tensor) -> torch.Tensor:  # [C, Q] values of the given ranks
        cols = []
        for r in rank[0].tolist():
            cols.append(smallest[r] if r < n // 2 else largest[n - 1 - r])
        return torch.stack(cols, dim=-1).contiguous()

    values = at(below)
    values.lerp_(at(above), weights.contiguous())
    return values.t()


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype = torch.float16):
    """``(scale, zero)`` of ranges, rounded to their storage ``dtype``."""
    return ((hi.float() - lo.float()) / 2).to(dtype), ((hi.float() + lo.float()) / 2).to(dtype)


def normalize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``clamp((x - zero) / scale, -1, 1)`` in float32; a zero scale maps to 0."""
    scale, zero = scale.float(), zero.float()
    flat = scale == 0
    y = (x.float() - zero) / torch.where(flat, torch.ones_like(scale), scale)
    return torch.where(flat, torch.zeros_like(y), y).clamp(-1, 1)


def uniform_codebook(levels: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, levels)


def midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """float32 decision boundaries between the neighbouring signposts of a sorted ``codebook``."""
    return ((codebook[1:] + codebook[:-1]) / 2).float()


def nearest_code(
    y: torch.Tensor, codebook: torch.Tensor | None, mid: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 index of the nearest signpost of a sorted ``codebook`` (ties go to the lower one).
    ``mid``: its :func:`midpoints` on ``y``'s device, for a caller that quantizes often with one
    codebook (then ``codebook`` is not read)."""
    if mid is None:
        mid = midpoints(codebook).to(y.device)
    return torch.bucketize(y.float().contiguous(), mid).to(torch.uint8)


def kmeans_start(v: torch.Tensor, levels: int) -> torch.Tensor:
    """Lloyd's starting signposts for the flat float32 ``v``: its ``(i + 1/2) / L`` quantiles (the
    uniform grid past 2^24 values, where ``torch.quantile`` refuses)."""
    probs = (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    return torch.quantile(v, probs.to(v.device)) if v.numel() <= 2**24 else uniform_codebook(levels)


def kmeans_1d(values: torch.Tensor, levels: int, iters: int = 100) -> torch.Tensor:
    """Sorted float32 ``[levels]`` signposts minimizing the squared error of ``values`` (Lloyd's
    algorithm from the ``(i + 1/2) / L`` quantiles; a cell left empty keeps its signpost). Stops at
    a fixed point: every signpost is the mean of the values nearest to it."""
    v = values.flatten().float()
    if v.numel() == 0:
        return uniform_codebook(levels)
    c = kmeans_start(v, levels)
    for _ in range(iters):
        c = torch.sort(c).values
        q = nearest_code(v, c).long()
        sums = torch.zeros(levels, device=v.device).index_add_(0, q, v)
        counts = torch.zeros(levels, device=v.device).index_add_(0, q, torch.ones_like(v))
        new = torch.where(counts > 0, sums / counts.clamp(min=1), c)
        if torch.equal(new, c):
            break
        c = new
    return torch.sort(c).values


def key_outliers(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fraction: float):
    """Key outliers: elements outside the calibrated ``[zero - scale, zero + scale]`` of their channel."""
    if fraction <= 0:
        return None
    return (x.float() - zero.float()).abs() > scale.float()


# the least float32 above 1: where every element beyond its threshold ranks, at the least
_ABOVE_ONE = 1.0 + torch.finfo(torch.float32).eps


def key_outliers_fixed(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fraction: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Threshold outliers (:func:`key_outliers`) held as a fixed count per vector: the channel
    indices ``[..., k]`` (ascending), ``k = outlier_count(D, fraction)``, of the elements of ``x
    [..., D]`` that exceed the calibrated range ``[zero - scale, zero + scale]`` of their channel
    the most, relative to it (``|x - zero| / scale - 1``), and the overflow ``[...]`` (int64) of
    each vector: its elements beyond the threshold that do not fit. None when k is 0.

    Every element beyond its threshold is kept while they fit (they rank above every element in
    range); slots left over hold the in-range elements nearest their channel's bounds, kept exactly
    too. Ties go to the lowest channel (a stable sort, as :func:`topk_outliers`). A channel of zero
    range ranks any element off its centre first."""
    k = outlier_count(x.shape[-1], fraction)
    if not k:
        return None
    dist = (x.float() - zero.float()).abs()
    scale = scale.float()
    beyond = dist > scale
    # the clamp keeps 0 / 0 off a zero-range channel; beyond elements are raised above every in-range
    # ratio (<= 1), which they could equal after rounding
    ratio = dist / scale.clamp(min=torch.finfo(torch.float32).tiny)
    rank = torch.where(beyond, ratio.clamp(min=_ABOVE_ONE), ratio)
    order = rank.sort(dim=-1, descending=True, stable=True).indices
    overflow = (beyond.sum(-1) - k).clamp(min=0)
    return order[..., :k].sort(dim=-1).values, overflow
