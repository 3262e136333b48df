"""GPU facts that the rules rely on, measured on the machine it runs on (CUDA only).

    python benchmarks/gpu_facts.py

- AR205/AR207: CUDA autocast refuses BCELoss (so the torch backend must not put it under
  autocast), and Fabric's bf16-mixed, which autocasts only the model's forward, runs it.
- AR212: BatchNorm in eval mode under true half precision on cuDNN: how far its output is from
  fp32 (running statistics kept in half).
- dropout under half precision on CUDA draws other masks than in fp32 (why mixed-precision
  comparisons of models with dropout differ more on a GPU than on a CPU).
Prints one line per fact.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def bce_under_autocast() -> str:
    p = torch.rand(8, device="cuda")
    y = torch.ones(8, device="cuda")
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            nn.BCELoss()(p, y)
        return "BCELoss under CUDA autocast: ran (unexpected)"
    except RuntimeError as exc:
        return f"BCELoss under CUDA autocast: RuntimeError: {str(exc).splitlines()[0][:110]}"


def bce_outside_autocast() -> str:
    net = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid()).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = net(torch.randn(8, 4, device="cuda"))
    loss = nn.BCELoss()(out.float(), torch.ones(8, 1, device="cuda"))  # what Fabric does: fp32 outputs
    return f"BCELoss on the forward's output cast to fp32, outside autocast: ran, loss {loss.item():.4f}"


def batchnorm_eval_half() -> list[str]:
    torch.manual_seed(0)
    out = []
    bn = nn.BatchNorm2d(64).cuda()
    bn.train()
    for _ in range(50):  # learn running statistics on data with a large mean and variance
        bn(torch.randn(32, 64, 16, 16, device="cuda") * 30 + 100)
    bn.eval()
    x = torch.randn(32, 64, 16, 16, device="cuda") * 30 + 100
    ref = bn(x)
    for dtype in (torch.float16, torch.bfloat16):
        half = nn.BatchNorm2d(64).cuda()
        half.load_state_dict(bn.state_dict())
        half = half.to(dtype).eval()
        err = (half(x.to(dtype)).float() - ref).abs().max().item()
        mean = (half(x.to(dtype)).float() - ref).abs().mean().item()
        out.append(f"BatchNorm2d eval in {str(dtype)[6:]} (cuDNN) vs fp32: max abs error {err:.3g}, "
                   f"mean {mean:.3g} (outputs of unit scale)")
    # running statistics updated in half: 200 training steps of momentum 0.1
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(1)
        a, b = nn.BatchNorm2d(64).cuda(), nn.BatchNorm2d(64).cuda().to(dtype)
        for _ in range(200):
            x = torch.randn(16, 64, 8, 8, device="cuda") * 30 + 100
            a(x)
            b(x.to(dtype))
        drift = ((b.running_var.float() - a.running_var).abs() / a.running_var).max().item()
        out.append(f"BatchNorm2d running_var after 200 steps in {str(dtype)[6:]}: max relative error "
                   f"{drift:.3g} against fp32")
    return out


def dropout_masks() -> str:
    """The same seed, dropout on an fp32 and on a bf16/fp16 tensor: the same mask?"""
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        a = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.1) != 0
        torch.manual_seed(0)
        b = torch.nn.functional.dropout(torch.ones(4096, device="cuda", dtype=dtype), 0.1) != 0
        out.append(f"{str(dtype)[6:]} {(a != b).float().mean().item():.1%}")
    return ("dropout with the same seed on fp32 vs half tensors (CUDA): masks differ in "
            + ", ".join(out) + " of the elements")


def main() -> None:
    assert torch.cuda.is_available(), "needs CUDA"
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(bce_under_autocast())
    print(bce_outside_autocast())
    print(dropout_masks())
    for line in batchnorm_eval_half():
        print(line)


if __name__ == "__main__":
    main()
