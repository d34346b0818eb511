"""Sequences of equal length stacked into one cache of B rows, and split back.

A batch of sequences that each hold the same number of tokens (a perplexity task's windows: every
context has the task's length) needs no padding: its rows can live in one cache of batch B, read
by one attention call per stored part for the whole batch, appended by one quantization per
forward, instead of B calls through the per-sequence path (:class:`~kvbench.cache.batch.
SequenceBatchCache`). :func:`stack_sequences` builds that cache from per-sequence caches (each
prefilled alone, as the shared prefill gives them), and :func:`split_sequences` hands each row back
to its sequence's cache, so that memory reports and :meth:`Method.end_request` see each sequence as
it would be alone.

Which layers stack is read from the layer, as for beam search (:func:`kvbench.cache.reorder.
batch_buffers`): everything a layer holds per sequence must sit in token buffers with the batch
first (full-precision tokens, packed codes, scales, zero points, residual windows), and the
sequences' buffers must agree in every size but the batch (the same tokens stored, the same
capacity, the same rows freed at the front). A layer holding anything else (eviction scores,
outlier pools, calibration state) makes :func:`stack_sequences` return None: the caller keeps the
per-sequence path.
"""

from __future__ import annotations

import copy

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.cache.reorder import _Unreorderable, batch_buffers


def _buffers(layer) -> list[GrowableTokens] | None:
    try:
        return batch_buffers(layer)
    except _Unreorderable:
        return None


def _shape_key(b: GrowableTokens) -> tuple:
    buf = b.buffer
    shape = None if buf is None else (tuple(buf.shape[1:]), buf.dtype, buf.device)
    return (shape, b.start, b.rows, b.tokens_per_row, b.dtype, b.static)


def _copy_with(layer, buffers: list[GrowableTokens]):
    """A copy of ``layer`` that shares its buffers' tensors (they are replaced right after) and
    copies everything else (counts, shapes, configuration)."""
    memo = {id(b.buffer): b.buffer for b in buffers if b.buffer is not None}
    return copy.deepcopy(layer, memo)


def stack_sequences(layers_per_sequence: list[list]) -> list | None:
    """The layers of one cache of ``B = len(layers_per_sequence)`` rows, row i holding sequence i's
    storage, or None where a layer holds state outside token buffers or the sequences' buffers
    differ in anything but the batch. The sequences' own layers are left as they are."""
    if len(layers_per_sequence) < 2:
        return None
    stacked = []
    for parts in zip(*layers_per_sequence, strict=True):
        found = [_buffers(layer) for layer in parts]
        if any(f is None for f in found) or len({len(f) for f in found}) != 1:
            return None
        if any(getattr(layer, "batch_size", 1) != 1 for layer in parts if layer.is_initialized):
            return None
        for group in zip(*found, strict=True):
            if len({_shape_key(b) for b in group}) != 1:
                return None
        layer = _copy_with(parts[0], found[0])
        if layer.is_initialized:
            layer.batch_size = len(parts)
        for target, group in zip(_buffers(layer), zip(*found, strict=True), strict=True):
            if group[0].buffer is not None:
                target.buffer = torch.cat([b.buffer for b in group])
        stacked.append(layer)
    return stacked


def split_sequences(stacked: list, rows: int) -> list[list]:
    """Row ``i`` of stacked layers (:func:`stack_sequences`) as the layers of a one-row cache, for
    each ``i < rows``; the rows are views of the stacked buffers (appends never write a row twice)."""
    out = []
    for i in range(rows):
        layers = []
        for layer in stacked:
            buffers = batch_buffers(layer)
            one = _copy_with(layer, buffers)
            if one.is_initialized:
                one.batch_size = 1
            for target, source in zip(batch_buffers(one), buffers, strict=True):
                if source.buffer is not None:
                    target.buffer = source.buffer[i : i + 1]
            layers.append(one)
        out.append(layers)
    return out
