"""opsd: operations and observability for long distributed PyTorch training runs (controller and CLI)."""

__version__ = "0.1.0"
