"""Verifier mutation case: BAD rewrite (planted bug): good_accumulate.py with
`loss.backward()` instead of `(loss / ACCUMULATE).backward()`.

The accumulated gradient is 2x the base.py gradient (AdamW is nearly scale
invariant, so the loss drift is small but real: weight decay and eps see it).
The printed loss is still the per-step mean, so only training drifts.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ACCUMULATE = 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    torch.manual_seed(0)
    x = torch.randn(128, 20)
    y = (x @ torch.randn(20, 4)).argmax(dim=1)  # learnable labels: a random linear teacher
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=16 // ACCUMULATE, shuffle=True, generator=torch.Generator().manual_seed(0))

    model = MLP()
    optimizer = torch.optim.AdamW(
        [{"params": model.body.parameters()}, {"params": model.head.parameters(), "lr": 1e-2}],
        lr=3e-3,
    )
    loss_fn = nn.CrossEntropyLoss()

    step = 0
    step_loss = 0.0
    for epoch in range(2):
        for i, (inputs, targets) in enumerate(loader):
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            step_loss += loss.item() / ACCUMULATE
            if (i + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
                print(f"epoch {epoch} step {step} loss {step_loss!r}")
                step += 1
                step_loss = 0.0


if __name__ == "__main__":
    main()
