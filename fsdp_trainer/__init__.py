"""fsdp_trainer: a small, pure-PyTorch, FSDP2-native trainer."""

__version__ = "0.1.0"
