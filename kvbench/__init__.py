"""kvbench: KV-cache quantization methods, reproduced and measured."""

__version__ = "0.1.0"
