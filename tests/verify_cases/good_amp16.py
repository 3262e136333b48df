"""Verifier mutation case: GOOD rewrite of base.py to native mixed precision on CPU.

float16 autocast around forward + loss, one GradScaler("cpu") scaling the
loss, stepping the optimizer and updating the scale. Losses are close to
base.py but not identical (fp16 rounding).
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))

    model = MLP()
    optimizer = torch.optim.AdamW(
        [{"params": model.body.parameters()}, {"params": model.head.parameters(), "lr": 1e-2}],
        lr=3e-3,
    )
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu")

    step = 0
    for epoch in range(2):
        for inputs, targets in loader:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            print(f"epoch {epoch} step {step} loss {loss.item()!r}")
            step += 1


if __name__ == "__main__":
    main()
