"""Precision migrations and pitfalls: torch.cuda.amp and apex.amp to current APIs, pure .half() traps, the script's own autocast."""
