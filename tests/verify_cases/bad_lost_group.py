"""Verifier mutation case: BAD rewrite (planted bug): good_fabric.py whose
optimizer lost the head parameter group (the head is never updated).
"""
import torch
from lightning.fabric import Fabric
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
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.launch()

    torch.manual_seed(0)
    x = torch.randn(128, 20)
    y = (x @ torch.randn(20, 4)).argmax(dim=1)  # learnable labels: a random linear teacher
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))

    model = MLP()
    optimizer = torch.optim.AdamW(
        [{"params": model.body.parameters()}],
        lr=3e-3,
    )
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    loss_fn = nn.CrossEntropyLoss()

    step = 0
    for epoch in range(2):
        for inputs, targets in loader:
            loss = loss_fn(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            print(f"epoch {epoch} step {step} loss {loss.item()!r}")
            step += 1


if __name__ == "__main__":
    main()
