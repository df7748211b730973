"""rankwatch: telemetry analytics and straggler detection for large distributed PyTorch training."""

__version__ = "0.1.0"
__all__ = ["__version__"]
