"""timm.utils: NativeScaler's behaviour (the loss scaled by a GradScaler of its own, backward,
optionally unscaled and clipped, the optimizer stepped, the scale updated) and init_distributed_device's."""
import torch


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device, enabled=torch.cuda.is_available())

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(list(parameters), clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def init_distributed_device(args):
    """timm 1.0.29's: the process group started when the environment says several processes,
    ``args.distributed``, ``world_size``, ``rank``, ``local_rank``, ``device`` set, the device
    returned (here, as on one process without CUDA)."""
    import os

    args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if args.distributed:
        torch.distributed.init_process_group(backend="gloo")
    args.world_size = torch.distributed.get_world_size() if args.distributed else 1
    args.rank = torch.distributed.get_rank() if args.distributed else 0
    args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(args.device)
