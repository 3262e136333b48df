"""Data loading: DataLoader hints, fast tokenizers, dynamic padding, length-grouped batching."""
