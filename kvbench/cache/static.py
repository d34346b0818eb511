"""The static decode step: a cache preallocated to the request's capacity, whose every decode step
is the same sequence of device operations on the same buffers, so that it can be captured once as a
CUDA graph and replayed (``method.cuda_graph=true``).

What makes a step replayable (each a rule the code below and the layers follow):

- **Fixed buffers.** :meth:`KVBenchCache.reserve` gives every store its capacity (prompt plus new
  tokens) before the prefill; a store is one zero-filled allocation that never grows
  (:meth:`~kvbench.cache.growable.GrowableTokens.reserve`).
- **Device-side lengths.** An append writes at the store's device row count with one
  ``index_copy_`` and adds to that count on the device; attention reads every store over its whole
  capacity and hides the entries past the count taken before this forward's append
  (``StoredTokens.hidden``, one comparison and ``masked_fill`` per layer in
  :func:`~kvbench.cache.blockwise.single_call_attention`). Kernel grids are sized by the capacity,
  which does not change. Reading the capacity costs the unwritten rows' bytes: at most the
  request's new tokens, next to a long prompt.
- **Host counts move outside the step.** The layers' token counts (what accounting, masks and the
  next step's Python read) advance only through :meth:`KVBenchCache.advance`, which the runner calls
  after each forward, captured or not. transformers' mask builder reads them and builds no mask for
  one unpadded sequence (:func:`kvbench.cache.attention.kvbench_mask`), so nothing of the step
  depends on them.
- **Inputs in fixed tensors.** :class:`StaticStep` feeds the token through a ``[1, 1]`` buffer and the
  position through a ``[1, 1]`` buffer the step itself advances on the device; the logits come back
  in the same tensor every step.

On a CUDA device :class:`StaticStep` runs the first decode step eagerly on a side stream (it
allocates, compiles Triton kernels, tunes), captures the second into a ``torch.cuda.CUDAGraph`` and
replays that graph for every later step. A layer whose steps come in kinds known on the host (KIVI
flushes its key residual every R steps: :meth:`KVBenchCache.step_kind`) gets one graph per kind,
each captured at that kind's second occurrence. Elsewhere (the CPU) every step runs the same static code
eagerly: that is what the tests check, with :func:`kvbench.kernels.replay.trace_step`, which
records two consecutive steps and requires them to be the same operations on the same persistent
tensors with no host sync (the condition for a replay to compute the next step).

Which methods have a static step is declared by each method's config
(:meth:`~kvbench.methods.base.MethodConfig.static_step_refusal`); others are refused in one line
before the model loads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_SEEN: set[str] = set()


def note_decode_step(mode: str) -> None:
    """Record how a request's decode steps ran (``eager``, ``static`` or ``graph``)."""
    _SEEN.add(mode)


def decode_steps_seen() -> str:
    """How this process's requests decoded so far, ``+``-joined (``graph``, ``eager+graph`` when
    scoring requests, which always run the growing cache, were mixed in), or ``none``."""
    return "+".join(sorted(_SEEN)) if _SEEN else "none"


class StaticStep:
    """Decode steps of one request over a static ``cache`` (already prefilled, host counts advanced).

    Args:
        forward: ``forward(input_ids [1, 1], position_ids [1, 1]) -> logits [1, 1, vocab]`` (float32),
            one model forward over ``cache``; it must advance ``position_ids`` in place by one (so
            that a replayed graph moves it too).
        cache: the request's :class:`~kvbench.cache.cache.KVBenchCache` after :meth:`reserve` and the
            prefill.
        position: the position of the first token fed (the prompt's length).
        capture: capture a CUDA graph at the second step and replay it from then on (CUDA only).
    """

    def __init__(self, forward: Callable, cache, position: int, device: torch.device, capture: bool):
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA device, not {device}")
        self.forward, self.cache, self.capture = forward, cache, capture
        self.input_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.position_ids = torch.full((1, 1), position, dtype=torch.long, device=device)
        self.graphs: dict[tuple, tuple] = {}  # step kind -> (graph, its logits)
        self.seen: dict[tuple, int] = {}  # step kind -> steps of that kind so far
        self.logits: torch.Tensor | None = None

    @property
    def mode(self) -> str:
        """What ran: ``graph`` (captured and replayed), ``static`` (the same step, eagerly)."""
        return "graph" if self.graphs else "static"

    @torch.no_grad()
    def body(self) -> torch.Tensor:
        """The device work of one step, what a graph captures: the forward on the step's buffers
        (the token already in :attr:`input_ids`); host counts are not moved."""
        return self.forward(self.input_ids, self.position_ids)

    def __call__(self, token: int) -> torch.Tensor:
        """Feed ``token``; returns the float32 logits ``[1, 1, vocab]`` of the next one (the same
        tensor every call once a graph is captured: read it before the next call)."""
        self.input_ids.fill_(token)
        kind = self.cache.step_kind()
        seen = self.seen.get(kind, 0)
        self.seen[kind] = seen + 1
        if kind in self.graphs:
            graph, self.logits = self.graphs[kind]
            graph.replay()
        elif self.capture and seen == 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self.body()
            self.graphs[kind] = (graph, self.logits)
            graph.replay()  # capturing ran nothing: this is the step
        elif self.capture:
            # the first step on a side stream, as capture requires of the work before it
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.logits = self.body()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.logits = self.body()
        self.cache.advance(1)
        return self.logits
