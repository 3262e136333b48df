"""The harness's hooks into torch (a mixin of harness.py's ``Recorder``): clipping, the forward
under a mixed precision (the noise run), autocast and the forward's precision, DistributedSampler,
the DataLoader's batch size, GradScaler. Loaded from its file as the harness is; torch comes in
as the argument of each hook, once the script has imported it.
"""

from __future__ import annotations


class Hooks:
    """``Recorder``'s hooks (``self`` is the Recorder: its fields are set in its ``__init__``)."""

    def _hook_clip(self, torch) -> None:
        """The norm each clip measured before it clipped (what ``clip_grad_norm_`` returns;
        ``fabric.clip_gradients`` calls it too): clipped, two runs apply gradients of the same
        norm whatever they computed, so the step records this one as well."""
        import torch.nn.utils.clip_grad as clip_grad

        recorder = self
        original = clip_grad.clip_grad_norm_

        def clip_grad_norm_(*args, **kwargs):
            total = original(*args, **kwargs)
            try:  # (parameters, max_norm, ...): the threshold, for where the runs part (issue 48)
                recorder.clip_max = float(kwargs["max_norm"] if "max_norm" in kwargs else args[1])
            except (IndexError, KeyError, TypeError, ValueError):
                recorder.clip_max = None
            try:
                recorder.clip_norm = float(total)
            except (TypeError, ValueError, RuntimeError):
                recorder.clip_norm = None
            return total

        clip_grad_norm_.__wrapped__ = original
        clip_grad_norm_.__doc__ = original.__doc__
        clip_grad.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

    def _hook_forward(self, torch, dtype) -> None:
        """What ``_FabricModule.forward`` does under a mixed precision (lightning/fabric/wrappers.py
        and plugins/precision/amp.py), done to the outermost module call instead of the set-up
        modules the original does not have."""
        from lightning_utilities.core.apply_func import apply_to_collection

        recorder = self
        Module, Tensor = torch.nn.Module, torch.Tensor
        original = Module.__call__

        def cast(data, dst_type):
            return apply_to_collection(data, dtype=Tensor, function=lambda t: t.to(dst_type)
                                       if torch.is_floating_point(t) else t)

        def __call__(self_, *args, **kwargs):
            if recorder._forward_depth:
                return original(self_, *args, **kwargs)
            first = next(self_.parameters(), None)
            if first is None:  # a loss module, an activation: not what Fabric sets up
                return original(self_, *args, **kwargs)
            recorder._forward_depth += 1
            try:
                args, kwargs = cast((args, kwargs), dtype)
                with torch.autocast(first.device.type, dtype=dtype):
                    output = original(self_, *args, **kwargs)
            finally:
                recorder._forward_depth -= 1
            return cast(output, torch.get_default_dtype())

        __call__.__wrapped__ = original
        Module.__call__ = __call__

    def _hook_autocast(self, torch) -> None:
        recorder = self
        cls = torch.amp.autocast_mode.autocast
        original = cls.__enter__
        if self.force_fp32:
            original_init = cls.__init__

            def __init__(self_, *args, **kwargs):
                # (device_type, dtype=None, enabled=True, cache_enabled=None)
                if len(args) >= 3:
                    args = (*args[:2], False, *args[3:])
                else:
                    kwargs["enabled"] = False
                original_init(self_, *args, **kwargs)

            cls.__init__ = __init__

        def __enter__(self_):
            result = original(self_)
            entry = [self_.device, str(self_.fast_dtype).replace("torch.", ""),
                     bool(torch.is_autocast_enabled(self_.device))]
            if entry not in recorder.autocast:
                recorder.autocast.append(entry)
            return result

        cls.__enter__ = __enter__

    def _hook_forward_autocast(self, torch) -> None:
        """The autocast in force inside the training forwards (issue 59): read where each module's
        forward begins with gradients on, for the first calls only (a hook on every call of every
        module would weigh on the step times the verifier compares)."""
        recorder = self
        calls = [0]
        get_dtype = getattr(torch, "get_autocast_dtype", None)

        def hook(module, args):
            if not torch.is_grad_enabled():
                return
            calls[0] += 1
            if calls[0] > 256:
                handle.remove()
                return
            try:  # (torch.is_autocast_enabled(device_type): torch 2.4 and later)
                entries = [[device, str(get_dtype(device) if get_dtype is not None else "?").replace("torch.", "")]
                           for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]
            except (TypeError, RuntimeError):
                handle.remove()
                return
            for entry in entries or [[None, "float32"]]:
                if entry not in recorder.forward_autocast:
                    recorder.forward_autocast.append(entry)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)

    def _hook_distributed_sampler(self, torch) -> None:
        """A DistributedSampler (Fabric's setup_dataloaders under ddp puts one in, even on one
        device) orders the samples its own way: the verifier names that as a data order change."""
        try:
            from torch.utils.data.distributed import DistributedSampler
        except ImportError:  # pragma: no cover
            return
        recorder = self
        original = DistributedSampler.__init__

        def __init__(self_, *args, **kwargs):
            original(self_, *args, **kwargs)
            entry = [int(getattr(self_, "num_replicas", 1)), bool(getattr(self_, "shuffle", False))]
            if entry not in recorder.distributed_samplers:
                recorder.distributed_samplers.append(entry)

        DistributedSampler.__init__ = __init__

    def _hook_data_loader(self, torch) -> None:
        """The batch size of every DataLoader iterated: where they all agree, a step's samples are
        known. (``__iter__``, not ``__init__``: Fabric reads the constructor's signature to make a
        loader again with a DistributedSampler.)"""
        import functools

        recorder = self
        cls = torch.utils.data.DataLoader
        original = cls.__iter__

        @functools.wraps(original)
        def __iter__(self_):
            size = getattr(self_, "batch_size", None)
            if isinstance(size, int) and size not in recorder.batch_sizes:
                recorder.batch_sizes.append(size)
            return recorder._sampled_iter(self_, original)  # harness_shards.py: several processes

        cls.__iter__ = __iter__
        if self.replay_counts:  # the run on the processes' joined batches (harness_shards.py)
            length = cls.__len__

            @functools.wraps(length)
            def __len__(self_):
                return recorder._replayed_len(self_, length)

            cls.__len__ = __len__

    def _hook_grad_scaler(self, torch) -> None:
        recorder = self
        cls = torch.amp.grad_scaler.GradScaler
        original_init, original_scale = cls.__init__, cls.scale

        def __init__(self_, *args, **kwargs):
            if recorder.force_fp32:  # (device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
                if len(args) >= 6:
                    args = (*args[:5], False, *args[6:])
                else:
                    kwargs["enabled"] = False
            original_init(self_, *args, **kwargs)
            entry = [str(getattr(self_, "_device", "cuda")), bool(self_.is_enabled())]
            if entry not in recorder.grad_scaler:
                recorder.grad_scaler.append(entry)

        original_step = cls.step

        def step(self_, optimizer, *args, **kwargs):
            # a step the scaler skips (inf/NaN gradients) calls no optimizer hook: record it
            # here, so that its loss is not added to the next step's and the steps stay aligned
            recorder._stepped = False
            result = original_step(self_, optimizer, *args, **kwargs)
            if not recorder._stepped:
                recorder._end_step(optimizer, closure=None, skipped=True)
            return result

        def scale(self_, outputs):
            result = original_scale(self_, outputs)
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and result is not outputs:
                recorder.scaled[id(result)] = float(outputs.detach().float().item())
            return result

        cls.__init__ = __init__
        cls.scale = scale
        cls.step = step

    # ---- recording ---------------------------------------------------------------------------
