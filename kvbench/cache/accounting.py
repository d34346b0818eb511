"""Memory accounting from the tensors a cache actually holds.

Definitions (per run, summed over layers, keys and values together):

- ``n_values``: key/value elements the cache represents, ``2 * B * H_kv * T * D`` per layer, with
  ``T`` the tokens the FP16 reference (transformers' own cache) holds there
  (:meth:`KVLayer.reference_tokens`): every token, except in a sliding-window layer, which holds only
  its window (:mod:`kvbench.cache.sliding`; the window's bytes are the ``window`` component).
- ``bytes``: per component, ``numel * element_size`` of every tensor a layer reports in
  :meth:`KVLayer.held_tensors`; nothing is estimated.
- ``code_bits``: ``8 * bytes(codes) / quantized_values`` (packed width, padding included).
- ``nominal_code_bits``: mean log2(levels) over the quantized elements (the papers' "bits").
- ``effective_bits``: ``8 * total_bytes / n_values`` (codes, scales, zeros, residual windows,
  sinks, outliers: everything).
- ``compression``: FP16 bytes of the same tokens over total bytes.
- ``read_bits``: for methods that read less than they hold (ReadKV), payload bits read per stored
  value per decode query; None for methods that read everything they hold.
- ``read_bytes_per_step``: for those methods, the bytes their decode reads move per step (summed
  over layers, :meth:`KVLayer.read_traffic`); None for the others, which read what they hold.

Device and host: ``bytes``, ``effective_bits`` and ``compression`` count what the accelerator holds
(:meth:`KVLayer.held_tensors`; for every method that does not offload, that is everything). A layer
that also keeps tensors in host memory (SpeCache's full-precision copy) reports them in
:meth:`KVLayer.host_tensors`; they are summed apart into ``host_bytes_by_component`` /
``host_bytes`` and never enter the device figures. A layer that moves tokens host -> accelerator
reports :meth:`KVLayer.prefetch_stats` ``-> (fetches, entries, bytes)``; the report gives the means
per fetch (one fetch per layer per decode forward, summed over layers):
``prefetch_entries_per_step`` ((token, KV head) pairs) and ``prefetch_bytes_per_step``, None where
nothing was fetched.

Held and reserved: stores grow in doubling buffers (:mod:`kvbench.cache.growable`), so a layer
allocates up to twice what it holds. Every figure above counts the bytes in use (the rows a store
holds); ``reserved_bytes`` is the allocation, spare capacity included, reported beside them
(:meth:`KVLayer.bytes_reserved`) and never folded into them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvbench.cache.layer import KVLayer


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class MemoryReport:
    tokens: int
    n_values: int
    quantized_values: int
    bytes_by_component: dict[str, int] = field(default_factory=dict)
    nominal_code_bits_sum: float = 0.0
    read_bits_sum: int = 0
    read_values: int = 0
    read_steps: int = 0
    read_bytes: int = 0
    host_bytes_by_component: dict[str, int] = field(default_factory=dict)
    prefetch_steps: int = 0
    prefetch_entries: int = 0
    prefetch_bytes: int = 0
    # allocated by the layers' doubling buffers, spare capacity included; never part of the figures
    reserved_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_component.values())

    @property
    def device_bytes(self) -> int:
        return self.total_bytes

    @property
    def host_bytes(self) -> int:
        return sum(self.host_bytes_by_component.values())

    @property
    def prefetch_entries_per_step(self) -> float | None:
        return self.prefetch_entries / self.prefetch_steps if self.prefetch_steps else None

    @property
    def prefetch_bytes_per_step(self) -> float | None:
        return self.prefetch_bytes / self.prefetch_steps if self.prefetch_steps else None

    @property
    def fp16_bytes(self) -> int:
        return 2 * self.n_values

    @property
    def effective_bits(self) -> float:
        return 8 * self.total_bytes / self.n_values if self.n_values else float("nan")

    @property
    def code_bits(self) -> float:
        codes = self.bytes_by_component.get("codes", 0)
        return 8 * codes / self.quantized_values if self.quantized_values else float("nan")

    @property
    def nominal_code_bits(self) -> float:
        return self.nominal_code_bits_sum / self.quantized_values if self.quantized_values else float("nan")

    @property
    def read_bits(self) -> float | None:
        return self.read_bits_sum / self.read_values if self.read_values else None

    @property
    def read_bytes_per_step(self) -> float | None:
        return self.read_bytes / self.read_steps if self.read_steps else None

    @property
    def compression(self) -> float:
        return self.fp16_bytes / self.total_bytes if self.total_bytes else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        for internal in ("nominal_code_bits_sum", "read_bits_sum", "read_values", "read_steps", "read_bytes"):
            d.pop(internal)
        d.update(
            total_bytes=self.total_bytes,
            fp16_bytes=self.fp16_bytes,
            effective_bits=self.effective_bits,
            code_bits=self.code_bits,
            nominal_code_bits=self.nominal_code_bits,
            compression=self.compression,
            read_bits=self.read_bits,
            read_bytes_per_step=self.read_bytes_per_step,
            device_bytes=self.device_bytes,
            host_bytes=self.host_bytes,
            prefetch_entries_per_step=self.prefetch_entries_per_step,
            prefetch_bytes_per_step=self.prefetch_bytes_per_step,
            quantized_fraction=self.quantized_values / self.n_values if self.n_values else 0.0,
        )
        return d


def memory_report(layers: list[KVLayer]) -> MemoryReport:
    """Account every initialized layer of a cache."""
    report = MemoryReport(tokens=0, n_values=0, quantized_values=0)
    for layer in layers:
        if not layer.is_initialized:
            continue
        for component, tensors in layer.host_tensors().items():
            report.host_bytes_by_component[component] = report.host_bytes_by_component.get(
                component, 0
            ) + tensor_bytes(tensors)
        prefetch = layer.prefetch_stats()
        if prefetch is not None:
            fetches, entries, nbytes = prefetch
            # each decode forward fetches once per layer: a step is a fetch of the busiest layer
            report.prefetch_steps = max(report.prefetch_steps, fetches)
            report.prefetch_entries += entries
            report.prefetch_bytes += nbytes
        report.tokens = max(report.tokens, layer.num_tokens)
        report.n_values += (
            2 * layer.batch_size * layer.num_kv_heads * layer.reference_tokens() * layer.head_dim
        )
        report.quantized_values += layer.quantized_values()
        report.nominal_code_bits_sum += layer.nominal_code_bits()
        read_bits, read_values = layer.read_stats()
        report.read_bits_sum += read_bits
        report.read_values += read_values
        traffic = layer.read_traffic()
        if traffic is not None:
            # every layer reads once per decode step: a step is a read of the busiest layer
            report.read_steps = max(report.read_steps, traffic[0])
            report.read_bytes += traffic[1]
        report.reserved_bytes += layer.bytes_reserved()
        for component, tensors in layer.held_tensors().items():
            report.bytes_by_component[component] = report.bytes_by_component.get(component, 0) + tensor_bytes(
                tensors
            )
    return report
