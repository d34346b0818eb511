"""kvbench's version, on the bottom floor so that any module can read it without importing the
package's front door (``kvbench/__init__.py`` re-exports it as ``kvbench.__version__``)."""

__version__ = "0.1.0"
