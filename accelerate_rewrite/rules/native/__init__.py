"""The native plan (torch.autocast and torch.amp.GradScaler, --backend torch) and its rules."""
