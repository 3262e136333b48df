"""A corpus of training scripts for the speed benchmarks, generated deterministically.

``write_corpus(folder)`` writes the fixtures' inputs (``fixture_<name>.py``) and generated
scripts of eight shapes (a train()/evaluate() pair per model, a loop at module level, a Trainer
class, the deprecated ``torch.cuda.amp`` API, a GAN, hand-made accumulation with a scheduler and
clipping, a Hugging Face style fine-tuning loop, and helper modules with no training in them),
each padded with a varying number of helper functions: by default 230 files, about 35,000 lines.
The same arguments give the same files, byte for byte.
"""

from __future__ import annotations

import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_IMPORTS = '''"""Generated benchmark script {name} ({shape})."""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
'''

_MODEL = '''

class {cls}(nn.Module):
    def __init__(self, in_features={inp}, hidden={hidden}, num_classes={out}):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(in_features if i == 0 else hidden, hidden) for i in range({depth})])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)
        self.dropout = nn.Dropout({dropout})

    def forward(self, x):
        for layer in self.layers:
            x = self.dropout(F.relu(layer(x)))
        return self.head(self.norm(x))
'''

_HELPER = '''

def {name}(values, scale={scale}, offset={offset}):
    """Helper {index}: a small statistic over a list of numbers."""
    total = 0.0
    count = 0
    for value in values:
        if value is None:
            continue
        total += (value - offset) * scale
        count += 1
    mean = total / max(count, 1)
    spread = math.sqrt(sum(((v - offset) * scale - mean) ** 2 for v in values if v is not None) / max(count, 1))
    return {{"mean": mean, "spread": spread, "count": count}}
'''

_DATA = '''

def make_loaders(batch_size, samples={samples}):
    x_train = torch.randn(samples, {inp})
    y_train = torch.randint(0, {out}, (samples,))
    x_val = torch.randn(samples // 4, {inp})
    y_val = torch.randint(0, {out}, (samples // 4,))
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True)
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=batch_size)
    return train_loader, val_loader
'''

_ARGS = '''

def parse_args():
    parser = argparse.ArgumentParser(description="{name}")
    parser.add_argument("--epochs", type=int, default={epochs})
    parser.add_argument("--lr", type=float, default={lr})
    parser.add_argument("--batch-size", type=int, default={batch})
    parser.add_argument("--out", default="checkpoints")
    return parser.parse_args()
'''

_FUNCTION_STYLE = '''

def train_one_epoch(model, optimizer, loader, device, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % {log_every} == 0:
            print(f"epoch {{epoch}} batch {{batch_idx}} loss {{loss.item():.4f}}")


def evaluate(model, loader, device):
    model.eval()
    correct = 0
    total_loss = 0.0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            total_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    return total_loss / len(loader.dataset), correct / len(loader.dataset)


def main():
    args = parse_args()
    torch.manual_seed({seed})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_loader, val_loader = make_loaders(args.batch_size)
    model = {cls}().to(device)
    optimizer = torch.optim.{opt}(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    best = 0.0
    for epoch in range(1, args.epochs + 1):
        train_one_epoch(model, optimizer, train_loader, device, epoch)
        val_loss, val_acc = evaluate(model, val_loader, device)
        scheduler.step()
        print(f"epoch {{epoch}} val loss {{val_loss:.4f}} acc {{val_acc:.3f}}")
        if val_acc > best:
            best = val_acc
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))


if __name__ == "__main__":
    main()
'''

_MODULE_LOOP = '''

args = parse_args()
torch.manual_seed({seed})
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
train_loader, val_loader = make_loaders(args.batch_size)
model = {cls}().to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.{opt}(model.parameters(), lr=args.lr)
if os.path.exists("resume.pt"):
    model.load_state_dict(torch.load("resume.pt"))

for epoch in range(args.epochs):
    model.train()
    running = 0.0
    for inputs, labels in train_loader:
        inputs, labels = inputs.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
        running += loss.item()
    model.eval()
    with torch.no_grad():
        correct = sum((model(x.to(device)).argmax(1) == y.to(device)).sum().item() for x, y in val_loader)
    print(f"epoch {{epoch}}: loss {{running / len(train_loader):.4f}}, accuracy {{correct / len(val_loader.dataset):.3f}}")
torch.save(model.state_dict(), "model.pt")
'''

_TRAINER = '''

class Trainer:
    def __init__(self, model, optimizer, train_loader, val_loader, device):
        self.model = model
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.device = device
        self.history = []

    def train_step(self, data, target):
        data, target = data.to(self.device), target.to(self.device)
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(data), target)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def fit(self, epochs):
        for epoch in range(epochs):
            self.model.train()
            losses = [self.train_step(data, target) for data, target in self.train_loader]
            self.history.append(sum(losses) / len(losses))
            print(f"epoch {{epoch}} loss {{self.history[-1]:.4f}} val {{self.validate():.3f}}")

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        correct = 0
        for data, target in self.val_loader:
            data, target = data.to(self.device), target.to(self.device)
            correct += (self.model(data).argmax(1) == target).sum().item()
        return correct / len(self.val_loader.dataset)


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_loader, val_loader = make_loaders(args.batch_size)
    model = {cls}().to(device)
    optimizer = torch.optim.{opt}(model.parameters(), lr=args.lr, weight_decay=1e-4)
    Trainer(model, optimizer, train_loader, val_loader, device).fit(args.epochs)


if __name__ == "__main__":
    main()
'''

_AMP_LEGACY = '''

def main():
    args = parse_args()
    device = "cuda"
    train_loader, val_loader = make_loaders(args.batch_size)
    model = {cls}().to(device)
    optimizer = torch.optim.{opt}(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()
    for epoch in range(args.epochs):
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            with torch.cuda.amp.autocast():
                loss = F.cross_entropy(model(data), target)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), {clip})
            scaler.step(optimizer)
            scaler.update()
        print(f"epoch {{epoch}} loss {{loss.item():.4f}}")
    torch.save({{"model": model.state_dict(), "scaler": scaler.state_dict()}}, "amp.pt")


if __name__ == "__main__":
    main()
'''

_GAN = '''

def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = {cls}(in_features=16, num_classes={inp}).to(device)
    discriminator = {cls}(in_features={inp}, num_classes=1).to(device)
    opt_g = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()
    train_loader, _ = make_loaders(args.batch_size)
    for epoch in range(args.epochs):
        for real, _ in train_loader:
            real = real.to(device)
            noise = torch.randn(real.size(0), 16, device=device)
            fake = generator(noise)
            opt_d.zero_grad()
            loss_d = criterion(discriminator(real), torch.ones(real.size(0), 1, device=device)) + \\
                criterion(discriminator(fake.detach()), torch.zeros(real.size(0), 1, device=device))
            loss_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            loss_g = criterion(discriminator(fake), torch.ones(real.size(0), 1, device=device))
            loss_g.backward()
            opt_g.step()
        print(f"epoch {{epoch}} d {{loss_d.item():.4f}} g {{loss_g.item():.4f}}")


if __name__ == "__main__":
    main()
'''

_ACCUMULATE = '''

def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_loader, val_loader = make_loaders(args.batch_size)
    model = {cls}().to(device)
    optimizer = torch.optim.{opt}(model.parameters(), lr=args.lr)
    steps = args.epochs * len(train_loader) // {accum}
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps + 1)
    for epoch in range(args.epochs):
        model.train()
        for step, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            loss = F.cross_entropy(model(data), target) / {accum}
            loss.backward()
            if (step + 1) % {accum} == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip})
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        state = torch.load("state.pt") if os.path.exists("state.pt") else None
        print(f"epoch {{epoch}} loss {{loss.item():.4f}} resumed {{state is not None}}")


if __name__ == "__main__":
    main()
'''

_HF = '''

def main():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels={out})
    model.to(device)
    texts = ["a sample sentence number %d" % i for i in range({samples})]
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
    labels = torch.randint(0, {out}, (len(texts),))
    loader = DataLoader(TensorDataset(encoded["input_ids"], encoded["attention_mask"], labels),
                        batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        model.train()
        for input_ids, attention_mask, label in loader:
            outputs = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                            labels=label.to(device))
            outputs.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"epoch {{epoch}} loss {{outputs.loss.item():.4f}}")


if __name__ == "__main__":
    main()
'''

_UTILS = '''"""Generated benchmark helper module {name}: data preparation, no training in it."""
import json
import math
import os
'''

SHAPES = {
    "function": _FUNCTION_STYLE,
    "module_loop": _MODULE_LOOP,
    "trainer_class": _TRAINER,
    "amp_legacy": _AMP_LEGACY,
    "gan": _GAN,
    "accumulate": _ACCUMULATE,
    "hf": _HF,
    "utils": None,
}


def script(index: int) -> tuple[str, str]:
    """The generated script number ``index``: (file name, text)."""
    rng = random.Random(index)
    shape = list(SHAPES)[index % len(SHAPES)]
    name = f"gen_{index:03d}_{shape}"
    values = {
        "name": name, "shape": shape, "cls": f"Net{index}", "inp": rng.choice([8, 16, 32, 64]),
        "hidden": rng.choice([32, 64, 128, 256]), "out": rng.choice([2, 4, 10]),
        "depth": rng.randint(1, 4), "dropout": rng.choice([0.0, 0.1, 0.2]),
        "samples": rng.choice([64, 128, 256]), "epochs": rng.randint(1, 5),
        "lr": rng.choice([0.1, 0.01, 1e-3]), "batch": rng.choice([8, 16, 32]),
        "opt": rng.choice(["SGD", "Adam", "AdamW"]), "seed": index, "log_every": rng.choice([10, 50]),
        "clip": rng.choice([0.5, 1.0, 5.0]), "accum": rng.choice([2, 4, 8]),
    }
    helpers = "".join(
        _HELPER.format(name=f"stat_{index}_{k}", scale=rng.choice([1, 2, 0.5]), offset=rng.randint(0, 3), index=k)
        for k in range(rng.randint(2, 14)))
    if shape == "utils":
        return f"{name}.py", _UTILS.format(name=name) + helpers
    parts = [_IMPORTS.format(**values), _MODEL.format(**values), helpers, _DATA.format(**values),
             _ARGS.format(**values), SHAPES[shape].format(**values)]
    return f"{name}.py", "".join(parts)


def write_corpus(folder: Path, generated: int = 208) -> tuple[int, int]:
    """Write the fixtures' inputs and ``generated`` scripts into ``folder``: (files, lines)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = lines = 0
    for path in sorted((ROOT / "fixtures").glob("*/input.py")):
        text = path.read_text(encoding="utf-8")
        (folder / f"fixture_{path.parent.name}.py").write_text(text, encoding="utf-8")
        files, lines = files + 1, lines + len(text.splitlines())
    for index in range(generated):
        name, text = script(index)
        compile(text, name, "exec", dont_inherit=True)  # valid Python, or stop here
        (folder / name).write_text(text, encoding="utf-8")
        files, lines = files + 1, lines + len(text.splitlines())
    return files, lines


if __name__ == "__main__":  # python benchmarks/corpus.py FOLDER
    import sys

    print(write_corpus(Path(sys.argv[1])))


# ---- a synthetic large input (rewrite_speed.py, speed_goals.py) ---------------------------------

def n_lines(source: str) -> int:
    return len(source.splitlines())


_HEADER = '''"""Synthetic benchmark input: {n} small classifiers, each with its own train()/evaluate().

Generated by benchmarks/rewrite_speed.py in the style of fixtures/train_function: one module,
one main() with argparse that builds every model, optimizer and scheduler and trains them side
by side on the same loaders.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
'''
_BLOCK = '''

class Net{k}(nn.Module):
    def __init__(self, in_features=20, hidden={hidden}, num_classes=4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train{k}(model, optimizer, loader, device):
    """Train model {k} for one epoch."""
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        print(f"model {k} batch {{batch_idx}} loss {{loss.item():.4f}}")


def evaluate{k}(model, loader, device):
    model.eval()
    total_loss = torch.zeros(1, device=device)
    correct = torch.zeros(1, device=device)
    count = 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            total_loss += F.cross_entropy(output, target, reduction="sum")
            correct += (output.argmax(dim=1) == target).sum()
            count += target.size(0)
    return total_loss.item() / count, correct.item() / count
'''
_MAIN = '''

def main():
    parser = argparse.ArgumentParser(description="Train {n} small classifiers")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    x_train = torch.randn(96, 20)
    y_train = torch.randint(0, 4, (96,))
    x_val = torch.randn(32, 20)
    y_val = torch.randint(0, 4, (32,))
    train_loader = DataLoader(
        TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True, num_workers=0
    )
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=args.batch_size, num_workers=0)
'''
_SETUP = '''
    model{k} = Net{k}().to(device)
    optimizer{k} = torch.optim.SGD(model{k}.parameters(), lr=args.lr, momentum=0.9)
    scheduler{k} = torch.optim.lr_scheduler.StepLR(optimizer{k}, step_size=1, gamma=0.5)
'''
_LOOP = '''
    for epoch in range(1, args.epochs + 1):
'''
_STEP = '''        train{k}(model{k}, optimizer{k}, train_loader, device)
        val_loss, val_acc = evaluate{k}(model{k}, val_loader, device)
        scheduler{k}.step()
        print(f"epoch {{epoch}} model {k} val loss {{val_loss:.4f}} val acc {{val_acc:.3f}}")
'''
_TAIL = '''

if __name__ == "__main__":
    main()
'''


def synthetic_source(models: int) -> str:
    return "".join([
        _HEADER.format(n=models),
        *(_BLOCK.format(k=k, hidden=16 + k % 4 * 8) for k in range(models)),
        _MAIN.format(n=models),
        *(_SETUP.format(k=k) for k in range(models)),
        _LOOP,
        *(_STEP.format(k=k) for k in range(models)),
        _TAIL,
    ])


def synthetic_of_lines(target: int) -> str:
    """The ``synthetic_source`` of the fewest models with at least ``target`` lines (the size
    curve's scripts: benchmarks/speed_goals.py, benchmarks/redesign_floor.py)."""
    models = max(1, round(target / 47.5))  # about 47.5 lines a model: a guess, then exact
    while models > 1 and n_lines(synthetic_source(models - 1)) >= target:
        models -= 1
    while n_lines(synthetic_source(models)) < target:
        models += 1
    return synthetic_source(models)
