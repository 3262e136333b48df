"""timm.optim.create_optimizer_v2's behaviour for the optimizers the fixtures ask for: AdamW or
SGD over the model's parameters, no weight decay on biases and norms."""
import torch


def create_optimizer_v2(model_or_params, opt="sgd", lr=None, weight_decay=0.0, momentum=0.9, **kwargs):
    decay, no_decay = [], []
    for name, param in model_or_params.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    if opt == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)
