"""Each paper's own accounting of storage, as data: how the paper counts bits, declared in its paper
file (``accounting:`` in ``kvbench/papers/<paper>.yaml``), and computed from what kvbench's archived
rows hold, beside kvbench's own bytes.

A storage claim ("3.7x memory saved", "2.65 effective bits per value", "a quarter of the reads") is
a statement under the paper's convention: what it counts (code bits, outliers, scales, metadata,
payload read) and what it leaves out. kvbench counts every byte it holds (``effective_bits``: codes
as packed, scales and zeros, outlier entries, full-precision tokens). Testing a paper's number
against kvbench's bytes judges a convention, not the paper; so a storage claim is tested under the
paper's accounting (does kvbench's configuration reach the paper's number when counted the
paper's way?) and the page shows kvbench's bytes on a second line with the difference, which
never decides the verdict.

The block's keys:

- ``counts``: how the paper counts, in words (what enters, what is left out, the reference);
- ``quote``: the document's own words the accounting rests on (one text or a list; checked by
  ``scripts/check_claim_sources.py`` like a claim's quote);
- ``reference_bits``: the bits per value of the cache the paper divides by (16: FP16);
- ``constants`` (optional): ``{name: {value: number, why: text}}``, the paper's convention's own
  numbers (an outlier entry's 32 bits, its model's head dimension), never a measured one;
- ``quantities``: ``{name: {paper: EXPR, kvbench: EXPR, as: bits|ratio|fraction, what: text,
  config: {...}}}``: ``paper`` counts one value the paper's way and ``kvbench`` kvbench's way, both in
  bits per value, from a row's stored columns (``code_bits``, ``nominal_code_bits``,
  ``read_bits``, ``effective_bits``, ``read_bytes_per_step``, ``n_values``...), its method node
  (``config.outlier_fraction``) and the constants, with ``+ - * /``, numbers and parentheses;
  ``as`` says what the claim states: ``bits`` (bits per value), ``ratio`` (``reference_bits /
  bits``: "6.9x smaller") or ``fraction`` (``bits / reference_bits``: "a quarter of the reads");
  ``config`` (optional) is a subset of the method node an arm must match (the TurboQuant count
  applies to TurboQuant-based runs only);
- ``differs``: what kvbench holds that the paper does not count (or counts otherwise), in words.

A claim tests it with ``accounted(arm, "quantity") >= x`` (``<=``, or ``==`` for "about x"): the
arm's mean of the paper's count, stated as ``as`` says, is compared with ``x`` at the precision
``x`` is written with (``6.9`` holds from 6.85: the paper rounds its numbers). It is arithmetic on
stored quantities, not a test: ``reproduced`` when the count reaches the number, ``evidence
against`` when the paper's own count of this configuration does not.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

AS = ("bits", "ratio", "fraction")
KEYS = ("counts", "quote", "reference_bits", "constants", "quantities", "differs")
REQUIRED = ("counts", "quote", "reference_bits", "quantities", "differs")
QUANTITY_KEYS = ("paper", "kvbench", "as", "what", "config")
QUANTITY_REQUIRED = ("paper", "kvbench", "as", "what")
_OPS = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide}


class AccountingError(ValueError):
    """A malformed ``accounting`` block: the key and what is wrong."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"accounting.{key}: {problem}")
        self.key, self.problem = key, problem


@dataclass(frozen=True)
class Quantity:
    """One counted quantity: the paper's expression and kvbench's, and how the claim states it."""

    name: str
    paper: str
    kvbench: str
    as_: str
    what: str
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Accounting:
    """A paper's accounting (see the module docstring)."""

    counts: str
    quote: tuple[str, ...]
    reference_bits: float
    quantities: Mapping[str, Quantity]
    differs: str
    constants: Mapping[str, float] = field(default_factory=dict)
    constants_why: Mapping[str, str] = field(default_factory=dict)

    def stated(self, quantity: Quantity, bits: float) -> float:
        """``bits`` per value as the claim states the quantity (bits, ratio or fraction)."""
        if quantity.as_ == "ratio":
            return self.reference_bits / bits if bits else math.inf
        if quantity.as_ == "fraction":
            return bits / self.reference_bits
        return bits


def _names(expr: str, key: str) -> set[str]:
    """The names an expression reads (``config.x`` as ``config.x``); AccountingError when it is not
    arithmetic on names and numbers."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        raise AccountingError(key, f"{expr!r} is not an expression") from None
    names: set[str] = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            walk(node.left)
            walk(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            walk(node.operand)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            pass
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "config"
        ):
            names.add(f"config.{node.attr}")
        else:
            raise AccountingError(key, f"{expr!r}: only + - * /, numbers, columns and config.KEY")

    walk(tree)
    return names


def parse_accounting(value: Any) -> Accounting:
    """The ``accounting`` block of a paper file, checked (AccountingError names the key)."""
    if not isinstance(value, dict):
        raise AccountingError("", f"must be a mapping of {', '.join(KEYS)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise AccountingError(unknown[0], f"unknown key; allowed: {', '.join(KEYS)}")
    missing = [k for k in REQUIRED if k not in value]
    if missing:
        raise AccountingError(missing[0], "missing")
    for key in ("counts", "differs"):
        if not isinstance(value[key], str) or not value[key].strip():
            raise AccountingError(key, "must be non-empty text")
    quote = value["quote"]
    quotes = tuple(quote) if isinstance(quote, list) else (quote,)
    if not quotes or not all(isinstance(q, str) and q.strip() for q in quotes):
        raise AccountingError("quote", "the document's words (a text or a list of texts)")
    ref = value["reference_bits"]
    if isinstance(ref, bool) or not isinstance(ref, (int, float)) or ref <= 0:
        raise AccountingError("reference_bits", f"a positive number, got {ref!r}")
    constants, why = {}, {}
    for name, c in (value.get("constants") or {}).items():
        if (
            not str(name).isidentifier()
            or not isinstance(c, dict)
            or set(c) != {"value", "why"}
            or isinstance(c["value"], bool)
            or not isinstance(c["value"], (int, float))
            or not isinstance(c["why"], str)
        ):
            raise AccountingError(f"constants.{name}", "{value: number, why: text}")
        constants[str(name)], why[str(name)] = float(c["value"]), c["why"]
    quantities = {}
    raw = value["quantities"]
    if not isinstance(raw, dict) or not raw:
        raise AccountingError("quantities", "a mapping {name: {paper, kvbench, as, what}}")
    for name, q in raw.items():
        key = f"quantities.{name}"
        if not isinstance(q, dict):
            raise AccountingError(key, f"a mapping of {', '.join(QUANTITY_KEYS)}")
        bad = sorted(set(q) - set(QUANTITY_KEYS))
        if bad:
            raise AccountingError(f"{key}.{bad[0]}", f"unknown key; allowed: {', '.join(QUANTITY_KEYS)}")
        absent = [k for k in QUANTITY_REQUIRED if k not in q]
        if absent:
            raise AccountingError(f"{key}.{absent[0]}", "missing")
        if q["as"] not in AS:
            raise AccountingError(f"{key}.as", f"{q['as']!r}: one of {', '.join(AS)}")
        for side in ("paper", "kvbench"):
            if not isinstance(q[side], str):
                raise AccountingError(f"{key}.{side}", "an expression (text)")
            _names(q[side], f"{key}.{side}")
        if "config" in q and not isinstance(q["config"], dict):
            raise AccountingError(f"{key}.config", "a subset of the method node (a mapping)")
        quantities[str(name)] = Quantity(
            str(name), q["paper"], q["kvbench"], q["as"], str(q["what"]), dict(q.get("config") or {})
        )
    return Accounting(
        counts=value["counts"],
        quote=quotes,
        reference_bits=float(ref),
        quantities=quantities,
        differs=value["differs"],
        constants=constants,
        constants_why=why,
    )


def _column(rows: pd.DataFrame, name: str, constants: Mapping[str, float]) -> np.ndarray:
    if name in constants:
        return np.full(len(rows), constants[name])
    if name.startswith("config."):
        key = name.partition(".")[2]
        configs = rows["method_config"] if "method_config" in rows else [{}] * len(rows)
        out = []
        for c in configs:
            v = c.get(key) if isinstance(c, dict) else None
            out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
        return np.array(out, dtype=float)
    if name not in rows.columns:
        raise KeyError(name)
    return pd.to_numeric(rows[name], errors="coerce").to_numpy(dtype=float)


def evaluate(expr: str, rows: pd.DataFrame, constants: Mapping[str, float]) -> np.ndarray:
    """``expr`` per row of ``rows`` (NaN where a column is missing on the row); KeyError names a
    column no row has."""
    tree = ast.parse(expr, mode="eval").body

    def ev(node: ast.AST) -> np.ndarray:
        if isinstance(node, ast.BinOp):
            with np.errstate(divide="ignore", invalid="ignore"):
                return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        if isinstance(node, ast.Constant):
            return np.full(len(rows), float(node.value))
        if isinstance(node, ast.Name):
            return _column(rows, node.id, constants)
        return _column(rows, f"config.{node.attr}", constants)  # ast.Attribute on config

    return np.asarray(ev(tree), dtype=float)


def decimals(text: str) -> int:
    """The decimals a number is written with (``"6.9"``: 1, ``"0.25"``: 2, ``"6"``: 0)."""
    text = text.strip().lstrip("+-")
    return len(text.partition(".")[2]) if "." in text and "e" not in text.lower() else 0


def reaches(value: float, op: str, bound: float, places: int) -> bool:
    """Whether ``value``, rounded to ``places`` decimals as the paper rounds, satisfies ``op bound``
    (``>=``, ``<=``, ``==``)."""
    shown = round(value, places)
    if op == ">=":
        return shown >= bound - 1e-12
    if op == "<=":
        return shown <= bound + 1e-12
    return math.isclose(shown, bound, rel_tol=0, abs_tol=10.0 ** -(places + 6))
