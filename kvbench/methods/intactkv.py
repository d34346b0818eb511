"""``intactkv``: IntactKV (Liu et al., "IntactKV: Improving Large Language Model Quantization by
Keeping Pivot Tokens Intact", Findings of ACL 2024), for KV-cache quantization.

The first tokens of the input ([BOS], and in chat models the system prompt) are pivot tokens: they
draw most of the attention (attention sinks) and their keys and values carry outliers far larger
than other tokens'. IntactKV keeps their KV lossless and quantizes the rest: with weights left in
full precision, as here, the KV the model computes for them is already the lossless IntactKV, so
the method is "the first ``tokens`` entries in FP16, every later token through ``base``".
``tokens=1`` is IntactKV_[B]; IntactKV_[P] sets ``tokens`` to the system prompt's token count.
(The paper's optional calibration of the cached pivot KV, a training step, is not implemented.)

The same mechanism is the ``sink_tokens`` option every method has; this node names it as a method
of its own so it appears as one in sweeps and tables: ``base`` is any method's node, and ``bits``
is passed to it unless it sets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.config import require
from kvbench.methods.base import Method, MethodConfig, build_method, register_method


@dataclass
class IntactKVConfig(MethodConfig):
    name: str = "intactkv"
    tokens: int = 1
    base: dict[str, Any] = field(default_factory=lambda: {"name": "kivi"})

    default_bits: ClassVar[float] = 2.0

    def __post_init__(self):
        super().__post_init__()
        require(
            self.tokens >= 1,
            "method.tokens",
            self.tokens,
            "a token count >= 1",
        )
        require(
            self.base.get("name") not in (None, "intactkv"),
            "method.base.name",
            self.base.get("name"),
            "the node of another method (e.g. kivi, uniform)",
        )
        # the sliding-window rule is the wrapper's: the runner reads it from this config
        # the backend too (unless the base sets its own): the base's layers are the ones that store
        # and read, and a base that does not implement it refuses it here
        node = {
            "bits": self.bits,
            "fp_dtype": self.fp_dtype,
            "backend": self.backend,
            **self.base,
            "sink_tokens": self.tokens,
            "sliding_windows": self.sliding_windows,
        }
        self.base_method = build_method(node)

    def stored_levels(self):
        return self.base_method.config.stored_levels()

    def check_model(self, shape):
        self.base_method.config.check_model(shape)

    def context_warnings(self, lengths):
        return self.base_method.config.context_warnings(lengths)


@register_method("intactkv")
class IntactKV(Method):
    arm_batch = True  # where its base's does (kvbench.generate.joins_arm_batch)
    stack_rows = True
    Config = IntactKVConfig
    fp16_prefill = True  # as its base's is (prefill_is_fp16)

    def new_cache(self, shape, model_dtype):
        return self.config.base_method.new_cache(shape, model_dtype)

    # the cache is the base method's: so is the prefill
    def prefill_is_fp16(self) -> bool:
        return self.config.base_method.prefill_is_fp16()

    def needs_prefill_logits(self) -> bool:
        return self.config.base_method.needs_prefill_logits()

    def base_label(self) -> str:
        return f"intactkv{self.config.tokens}-{self.config.base_method.base_label()}"

    def label(self) -> str:
        return self.base_label()
