"""Training techniques: accumulation, freezing, clipping, activation checkpointing, torch.compile, 8-bit optimizers."""
