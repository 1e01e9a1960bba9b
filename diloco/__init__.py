"""diloco: resilient, low-communication distributed training (Decoupled DiLoCo)."""

__version__ = "0.1.0"
