"""KV-cache methods. Every module in this package registers itself on import; importing the
package imports them all, so adding a method never touches this file."""

import importlib
import pkgutil

from kvbench.methods.base import METHODS, Method, MethodConfig, ModelShape, build_method, register_method

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Method", "MethodConfig", "ModelShape", "build_method", "register_method"]
