"""The worked example of a new method in CONTRIBUTING.md runs as written: built only from cache/
and quant/ parts, it stores, reads back and accounts what the docs say. It registers into a
private registry here, so the real one (which other tests enumerate) is untouched."""

import ast
import re
from pathlib import Path

import torch

from kvbench.cache import memory_report
from kvbench.cache.cache import KVBenchCache
from kvbench.config import build_config
from kvbench.registry import Registry

DOC = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"
IMPORT = "from kvbench.methods.base import Method, MethodConfig, check_group, register_method"


def example() -> tuple[dict, Registry]:
    text = DOC.read_text(encoding="utf-8")
    code = re.search(r"`kvbench/methods/window_affine\.py`:\n\n```python\n(.*?)```", text, re.S).group(1)
    assert IMPORT in code
    imported = {n.module for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)}
    assert all(
        m.startswith(("kvbench.cache", "kvbench.quant", "kvbench.config"))
        or m in ("kvbench.methods.base", "kvbench.methods.affine_base", "dataclasses", "typing")
        for m in imported
    )
    registry = Registry("method")
    namespace = {"register_method": registry.register}
    exec(compile(code.replace(IMPORT, IMPORT.removesuffix(", register_method")), str(DOC), "exec"), namespace)
    return namespace, registry


def test_the_worked_example_stores_reads_and_accounts():
    namespace, registry = example()
    cls = registry.get("window_affine")
    config = build_config(
        cls.Config, {"name": "window_affine", "bits": 1, "group_size": 2, "residual": 1}, "m"
    )
    method = cls(config)
    layer = method.make_layer(0, None, torch.float32)
    # one kv head, head_dim 2: tokens [0, 2], [4, 4], [1, 3]; two levels per group of 2 channels
    keys = torch.tensor([[[[0.0, 2.0], [4.0, 4.0], [1.0, 3.0]]]])
    KVBenchCache([layer]).update(keys, keys * 2, 0)
    k, v = layer.read()
    # z = min, s = max - min: [0, 2] -> codes 0, 1 -> exact; [4, 4] is flat -> z = 4; the newest
    # token stays in the window (fp16 of 1, 3: exact)
    assert k[0, 0].tolist() == [[0.0, 2.0], [4.0, 4.0], [1.0, 3.0]]
    assert torch.equal(v.float(), keys * 2)
    report = memory_report([layer])
    # per K and V: 2 tokens x 2 codes at 1 bit -> 1 packed byte each; one fp16 scale and zero per
    # token; the window: 1 token x 2 channels in fp16
    assert report.bytes_by_component == {"codes": 4, "scales": 8, "zeros": 8, "residual": 8}
    assert report.quantized_values == 8 and report.nominal_code_bits == 1.0
