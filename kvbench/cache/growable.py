"""Preallocated token buffers that grow by doubling, so that appending costs O(new tokens).

A :class:`GrowableTokens` holds ``[B, H_kv, capacity, X]`` (any dtype; X is the head dim for
full-precision tokens, the packed byte count for codes, the group count for per-token scales) and
uses rows ``[start, start + n)`` of the token axis. An append writes into the free rows after the
used ones; only when none are left is a buffer of twice the capacity allocated (or, when at most
half of it is in use because :meth:`pop_front` freed the front, the used rows are copied to the
front of a fresh buffer of the same capacity instead). Over N single-token appends the buffer is
therefore reallocated O(log N) times and each token is copied O(1) times on average, instead of
the O(N) copies per append of ``torch.cat``.

Grouped token axes (``tokens_per_row = G``): per-channel key statistics ``[B, H_kv, T // G, D]``
hold one row per completed group of G tokens; the buffer counts rows, and :attr:`num_tokens`
reports ``rows * G``.

Accounting: :meth:`view` and :meth:`bytes_in_use` cover the used rows only (what a method holds);
:meth:`bytes_reserved` is the whole allocation, reported separately and never added to a method's
memory figures.

Views returned by :meth:`view` alias the buffer, and rows once written are never overwritten in
place: an append writes past the used rows, :meth:`pop_front` only moves the start, and making
room (growing, or compacting after pops) copies the used rows into a fresh allocation. So a view
taken before an append or a pop still holds exactly the rows it held (a layer takes views of its
stores before this forward's tokens are appended and attends them afterwards); it keeps an old
allocation alive until it is dropped. Take a fresh view to see new rows.

Static mode (:meth:`GrowableTokens.reserve`, the graph-capturable decode step of
:mod:`kvbench.cache.static`): the buffer is allocated once at a fixed capacity, zero-filled, and
never grows; an append writes at a device-side row count (:attr:`length`, int64 ``[1]``) with one
``index_copy_``, so no operation of an append depends on a host integer that changes from step to
step, and a CUDA graph captured over one step replays the next. The host count (``rows``, what
:meth:`view` and the accounting read) moves only when the owner calls :meth:`advance`, after the
forward (captured or not) has run. Unwritten rows stay zero, so a read over the whole capacity
(:meth:`full_view`) meets finite values, which attention hides by the device length.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 16


class GrowableTokens:
    """A ``[B, H_kv, T, X]`` tensor held in a doubling buffer along the token axis (dim -2).

    Args:
        dtype: storage dtype; appended tensors are cast to it. None keeps the first append's dtype.
        tokens_per_row: G for a grouped token axis (one row per G tokens), 1 otherwise.
        min_capacity: rows of the first allocation, at least (then the next power of two that fits).
    """

    def __init__(
        self, dtype: torch.dtype | None = None, tokens_per_row: int = 1, min_capacity: int = MIN_CAPACITY
    ):
        if isinstance(tokens_per_row, bool) or not isinstance(tokens_per_row, int) or tokens_per_row < 1:
            raise ValueError(f"tokens_per_row must be a positive int, got {tokens_per_row!r}")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 1:
            raise ValueError(f"min_capacity must be a positive int, got {min_capacity!r}")
        self.dtype = dtype
        self.tokens_per_row = tokens_per_row
        self.min_capacity = min_capacity
        self.buffer: torch.Tensor | None = None  # [B, H_kv, capacity, X]
        self.start = 0  # first used row
        self.rows = 0  # used rows
        self.reallocations = 0  # fresh allocations, the first one included
        self.moves = 0  # compactions after pop_front into a fresh buffer of the same capacity
        self.fixed_capacity: int | None = None  # static mode (reserve)
        self.length: torch.Tensor | None = None  # static mode: rows written, on the device, int64 [1]

    # -- sizes --------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[-2]

    @property
    def num_tokens(self) -> int:
        return self.rows * self.tokens_per_row

    def __len__(self) -> int:
        """Used rows (tokens when ``tokens_per_row == 1``)."""
        return self.rows

    def bytes_in_use(self) -> int:
        if self.buffer is None:
            return 0
        b, h, _, x = self.buffer.shape
        return b * h * self.rows * x * self.buffer.element_size()

    def bytes_reserved(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    # -- reads --------------------------------------------------------------------------------
    def view(self) -> torch.Tensor | None:
        """The used rows ``[B, H_kv, n, X]`` (a view of the buffer), None before the first append."""
        if self.buffer is None:
            return None
        return self.buffer[..., self.start : self.start + self.rows, :]

    def tensors(self) -> list[torch.Tensor]:
        """What is held, for accounting: the used rows only (empty list when nothing is used)."""
        return [self.view()] if self.rows else []

    @property
    def static(self) -> bool:
        return self.fixed_capacity is not None

    def full_view(self) -> torch.Tensor | None:
        """Static mode: the whole buffer ``[B, H_kv, capacity, X]``, rows past :attr:`length` zero
        (None before the first append)."""
        return self.buffer

    # -- writes -------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Switch to static mode with room for ``capacity`` rows (before the first append)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if self.buffer is not None:
            raise ValueError("reserve() must come before the first append")
        self.fixed_capacity = capacity

    def advance(self, t: int) -> None:
        """Static mode: count ``t`` rows that appends have written on the device as used."""
        if not self.static:
            raise ValueError("advance() is for static buffers (reserve); appends count themselves")
        if self.rows + t > self.fixed_capacity:
            raise ValueError(
                f"static buffer of {self.fixed_capacity} rows cannot take {t} more after {self.rows}"
            )
        self.rows += t

    def _allocate_for(self, x: torch.Tensor) -> None:
        """The first allocation, for rows shaped like ``x [B, H_kv, t, X]``: zero-filled at the fixed
        capacity (static mode), else uninitialised at a power of two that fits; later appends must
        match it."""
        if self.buffer is not None:
            if x.shape[:-2] != self.buffer.shape[:-2] or x.shape[-1] != self.buffer.shape[-1]:
                raise ValueError(
                    f"appended tensor {tuple(x.shape)} does not match the buffer "
                    f"{tuple(self.buffer.shape[:-2])} + [t, {self.buffer.shape[-1]}]"
                )
            return
        self.dtype = self.dtype if self.dtype is not None else x.dtype
        if self.static:
            shape = (*x.shape[:-2], self.fixed_capacity, x.shape[-1])
            self.buffer = torch.zeros(shape, dtype=self.dtype, device=x.device)
            self.length = torch.zeros(1, dtype=torch.long, device=x.device)
        else:
            capacity = max(self.min_capacity, _next_power_of_two(x.shape[-2]))
            self.buffer = torch.empty(*x.shape[:-2], capacity, x.shape[-1], dtype=self.dtype, device=x.device)
        self.reallocations += 1

    def append(self, x: torch.Tensor) -> None:
        """Write ``x [B, H_kv, t, X]`` (t rows) after the used rows (static mode: at the device
        count, which moves on by t)."""
        self._allocate_for(x)
        t = x.shape[-2]
        if t == 0:
            return
        if self.static:
            rows = self.length + torch.arange(t, device=x.device)
            self.buffer.index_copy_(-2, rows, x.to(self.dtype))
            self.length.add_(t)
            return
        if self.start + self.rows + t > self.capacity:
            self._make_room(t)
        end = self.start + self.rows
        self.buffer[..., end : end + t, :].copy_(x)
        self.rows += t

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove the oldest ``n`` rows and return them (a view: popped rows are never overwritten).
        With a grouped axis ``n`` counts rows, not tokens."""
        if self.static:
            raise ValueError("a static buffer never pops: its rows are addressed from the front")
        if not 0 <= n <= self.rows:
            raise ValueError(f"pop_front(n={n}) with {self.rows} rows in use")
        if self.buffer is None:
            raise ValueError("pop_front on an empty buffer")
        front = self.buffer[..., self.start : self.start + n, :]
        self.start += n
        self.rows -= n
        return front

    def _make_room(self, t: int) -> None:
        needed = self.rows + t
        if self.start and needed <= self.capacity and self.rows <= self.capacity // 2:
            # The front freed by pop_front is enough, and at most half of the buffer is in use, so
            # compacting is paid for by the appends since the last one (a residual window's steady
            # state). Into a fresh buffer of the same capacity, never in place: views taken before
            # this append must keep their rows.
            fresh = torch.empty_like(self.buffer)
            fresh[..., : self.rows, :].copy_(self.view())
            self.buffer, self.start = fresh, 0
            self.moves += 1
            return
        capacity = max(self.capacity * 2, _next_power_of_two(needed))
        fresh = torch.empty(
            *self.buffer.shape[:-2],
            capacity,
            self.buffer.shape[-1],
            dtype=self.dtype,
            device=self.buffer.device,
        )
        fresh[..., : self.rows, :].copy_(self.view())
        self.buffer, self.start = fresh, 0
        self.reallocations += 1


def _next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
