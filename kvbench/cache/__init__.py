"""The KV cache on top of transformers' Cache API: layer storage, attention hook, accounting."""

from kvbench.cache.accounting import MemoryReport, memory_report
from kvbench.cache.attention import ATTN_IMPLEMENTATION
from kvbench.cache.cache import KVBenchCache
from kvbench.cache.layer import KVLayer

__all__ = ["ATTN_IMPLEMENTATION", "KVBenchCache", "KVLayer", "MemoryReport", "memory_report"]
