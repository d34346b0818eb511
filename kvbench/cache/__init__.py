"""The KV cache on top of transformers' Cache API: layer storage, attention hook, accounting."""

from kvbench.cache.accounting import MemoryReport, memory_report
from kvbench.cache.attention import ATTN_IMPLEMENTATION, register_attention, use_kvbench_attention
from kvbench.cache.cache import ATTENTION_KWARG, KVBenchCache
from kvbench.cache.layer import KVLayer

__all__ = [
    "ATTENTION_KWARG",
    "ATTN_IMPLEMENTATION",
    "KVBenchCache",
    "KVLayer",
    "MemoryReport",
    "memory_report",
    "register_attention",
    "use_kvbench_attention",
]
