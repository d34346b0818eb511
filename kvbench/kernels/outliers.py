"""Dense-and-sparse outlier corrections, shared by the compiled CPU reader
(:mod:`kvbench.kernels.cpu.parts`) and the Triton reader (:mod:`kvbench.kernels.triton_parts`).

A codebook part with outliers (KVQuant's, handed over as a
:class:`~kvbench.kernels.part_reads.PackedCodes` with its ``outliers``) is read as its dense codes
first; then one pass over the outlier entries adds what the codes got wrong there:
``q . (exact - reconstructed)`` to the scores (rotated to the token's position when the keys are
stored before RoPE), ``p_t (exact - reconstructed)`` to the mix. Each correction is one
compiled call (``outlier_scores``/``outlier_mix`` in ``cpu/sparse.cpp``) when the compiled module is
given, else the torch expression written out here, which is also what the compiled pass is tested
against (``tests/kernels/test_sparse_kernels.py``).
"""

from __future__ import annotations

import torch

from kvbench.quant.packing import chunk_layout, unpack


def _param_rows(x: torch.Tensor | None, tokens: int) -> int:
    """Tokens per parameter row of a codebook scale/zero: 0 for one fixed row, else 1."""
    return 0 if x is None or x.shape[-2] == 1 and tokens != 1 else 1


def _outlier_deltas(part):
    """``(bh, row, d, delta)`` of every outlier: its flat (batch, head) index, token, channel and
    exact value minus what the dense codes reconstruct there."""
    rows, cols, vals = part.outliers
    b, h, t, nbytes = part.codes.shape
    d_all = part.head_dim
    cols = cols.long()
    bh, d = cols // d_all, cols % d_all
    row = rows.long()
    c, m = chunk_layout(part.levels)
    flat = part.codes.reshape(b * h, t, nbytes) if part.codes.is_contiguous() else None
    if m == 1:
        byte = (
            part.codes[bh // h, bh % h, row, d // c].long() if flat is None else flat[bh, row, d // c].long()
        )
        code = torch.div(byte, part.levels ** (d % c), rounding_mode="floor") % part.levels
    else:
        packed = part.codes[bh // h, bh % h, row]
        code = unpack(packed, part.levels, d_all).gather(-1, d[:, None])[:, 0].long()
    recon = part.table[code]
    for p in (part.scale, part.zero):
        if p is None:
            continue
        full = p.expand(b, h, t, d_all)
        value = full[bh // h, bh % h, row, d].float()
        recon = recon * value if p is part.scale else recon + value
    return bh, row, d, vals.float() - recon


def _outlier_args(part):
    c, m = chunk_layout(part.levels)
    t = part.num_tokens
    rows, cols, vals = part.outliers
    return (
        part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m,
        _param_rows(part.scale, t), _param_rows(part.zero, t), rows, cols, vals,
    )  # fmt: skip


def _correct_scores(out, part, query, rope, module=None):
    """Add ``q . (exact - reconstructed)`` at every outlier (rotated to its position with RoPE):
    one compiled pass over the entries, or the torch expression of it below. ``part``: the codebook
    codes (a :class:`~kvbench.kernels.part_reads.PackedCodes`, or anything with its fields);
    ``rope``: the :class:`~kvbench.kernels.part_reads.RopeTable` when the keys are stored before
    RoPE (anything with ``table`` and ``first_position``), else None."""
    if module is not None and out.is_contiguous():
        cos = sin = None
        offset = 0
        if rope is not None:
            cos, sin = rope.table
            offset = rope.first_position
        module.outlier_scores(out, query, *_outlier_args(part), cos, sin, offset)
        return out
    bh, row, d, delta = _outlier_deltas(part)
    b, h, mrows, t = out.shape
    q = query.reshape(b * h, mrows, -1)
    view = out.view(b * h, mrows, t).transpose(1, 2)  # [BH, T, M]
    if rope is None:
        view.index_put_((bh, row), q[bh, :, d] * delta[:, None], accumulate=True)
        return out
    cos, sin = rope.table
    pos = row + rope.first_position
    half = part.head_dim // 2
    partner = torch.where(d < half, d + half, d - half)
    sign = torch.where(d < half, 1.0, -1.0)
    # RoPE of delta * e_d: delta cos at d, and +-delta sin at the partner channel
    term = q[bh, :, d] * (delta * cos[pos, d])[:, None]
    term = term + q[bh, :, partner] * (sign * delta * sin[pos, partner])[:, None]
    view.index_put_((bh, row), term, accumulate=True)
    return out


def _correct_mix(out, part, weights, module=None):
    """Add ``p_t (exact - reconstructed)`` at every outlier."""
    if module is not None and out.is_contiguous():
        module.outlier_mix(out, weights, *_outlier_args(part))
        return out
    bh, row, d, delta = _outlier_deltas(part)
    b, h, mrows, t = weights.shape
    p = weights.reshape(b * h, mrows, t)
    view = out.view(b * h, mrows, -1).transpose(1, 2)  # [BH, D, M]
    view.index_put_((bh, d), p[bh, :, row] * delta[:, None], accumulate=True)
    return out
