"""The in-process side of the verifier: records what a training script does, step by step.

It is started by ``boot/sitecustomize.py`` in every Python process of a verified run (the
script itself and, under DDP, every process Fabric launches), when ``ACCELERATE_REWRITE_VERIFY``
holds its configuration. The script runs as the user runs it (``python train.py args``: its own
``__main__``, argparse, ``if __name__ == "__main__"``); nothing in the user's files is edited.

Once torch is imported (not before: a script may set CUDA_VISIBLE_DEVICES first), it seeds
torch, random and numpy, and hooks the places every variant of a training loop passes through:

- ``Tensor.backward`` / ``torch.autograd.backward`` (so also ``fabric.backward``): the value of
  each scalar loss. A loss scaled by a GradScaler (``scaler.scale(loss)``, Fabric's 16-mixed)
  is recorded unscaled.
- every optimizer step (a global post-step hook): the step's loss is the sum of the losses
  backwarded since the previous step (one loss; the micro-batch losses of an accumulating
  rewrite, which divides each by N, add up to their mean; a GAN's D terms add up to errD), or,
  for a step with a closure (LBFGS), the loss at the start of the step. Also the wall time since
  the previous step (CUDA-synchronised), per optimizer in the order they first step; and,
  just before the step, the norm of the gradient it applies.
- ``GradScaler.step``: a step it skips (inf gradients) still counts as a step, with its loss.
- ``torch.autocast`` and ``GradScaler``: which precision really ran (autocast("cuda") on a
  machine without CUDA disables itself; Fabric turns 16-mixed into bf16 on CPU).
- with ``trace_precision`` (the rewritten run under a mixed or half precision): per step, the
  half dtypes in the autograd graph of the losses it backwarded (each node's input metadata,
  read before the backward frees the graph). That is the evidence that the forward which fed
  this step ran in low precision: an autocast elsewhere (an evaluation loop) leaves none.
- ``DistributedSampler``: one in the run (Fabric's under ddp, even on one device) orders the
  data its own way.
- where the runs part (issue 48, harness_where.py), for the first optimizer: per step, the gradient
  norm and the update size (the norm of the change the step made) of each parameter group and of
  each top-level module of the model(s) it trains (their ``named_children()``), each group's lr,
  and the max_norm a clip was called with; at the first step, each group's settings (lr,
  weight_decay, betas, eps, momentum...) and the parameters with ``requires_grad`` False; the
  parameters in no optimizer's group. Norms only: the update is measured against a copy on the
  CPU made just before the step and dropped right after it; the time it takes is left out of
  the step's time.
- on several processes (harness_shards.py): the sample indices of every batch each process's
  loaders draw, and the original run again on the union of the processes' batches.
- with ``track_params`` (``--freeze``): a fingerprint (blake2b of the bytes) of every parameter
  of the model the first optimizer trains, by name (wrappers' prefixes taken off), before the
  first step and at the end.

After ``max_steps`` steps of the first optimizer it stops the script cleanly (SystemExit(0)).
At exit it writes ``rank{R}-{pid}.json`` into the run's folder; also during the run (at most
every SNAPSHOT_EVERY_S seconds of steps) and on SIGTERM (the verifier's timeout), so that a
script that hangs or is killed still reports the steps it made. Only the standard library is
imported before torch is.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional

CONFIG_ENV = "ACCELERATE_REWRITE_VERIFY"
#: the record is written again after a step when this long has passed since the last write
SNAPSHOT_EVERY_S = 0.5


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after the module ``name`` has been imported."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback
        self.done = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.done:
            return None
        self.done = True
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original = loader.exec_module
        callback = self.callback

        def exec_module(module):
            original(module)
            callback(module)

        loader.exec_module = exec_module
        return spec



def _sibling(name: str):
    """A module of the harness, loaded from its file next to this one, as sitecustomize loads
    this one: the run's Python need not have accelerate_rewrite installed."""
    import importlib.util

    key = f"accelerate_rewrite_verify_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_Where = _sibling("harness_where").Where
Hooks = _sibling("harness_hooks").Hooks
Shards = _sibling("harness_shards").Shards


class Recorder(Hooks, Shards):
    def __init__(self, config: dict) -> None:
        self.out_dir: str = config["out_dir"]
        self.max_steps: Optional[int] = config.get("max_steps")
        self.seed: int = int(config.get("seed", 0))
        self.threads: Optional[int] = config.get("threads")
        #: per step, the half dtypes in the autograd graph of the losses it backwarded
        #: (the half dtype asked for, "float16" or "bfloat16": the walk stops when it is found)
        self.trace_precision: Any = config.get("trace_precision") or False
        #: a fingerprint of every parameter of the model before the first step and at the end
        self.track_params: bool = bool(config.get("track_params"))
        #: the structure run (issue 27.1): every autocast and GradScaler switched off (Fabric's
        #: precision is set to 32-true by the verifier, LT_PRECISION), so that what is left of the
        #: rewrite is compared with the original exactly
        self.force_fp32: bool = bool(config.get("force_fp32"))
        #: the noise run (issue 27.1): the original with every outermost call of a module that has
        #: parameters run as Fabric's mixed precision runs a set-up module (inputs cast to this
        #: half dtype, the forward under torch.autocast, the outputs cast back to fp32), so that
        #: the difference the precision alone makes to this script is measured
        self.autocast_forward: Optional[str] = config.get("autocast_forward")
        #: where the runs part (issue 48): per step, each group's and top-level module's gradient
        #: norm and update size (``_Where``), for the first optimizer
        self.where_on: bool = bool(config.get("where", True))
        self.where: Optional[_Where] = None
        self.where_error: Optional[str] = None
        self._where_s = 0.0  # the time the records took, left out of the step's time
        self._optimizer_refs: list = []  # every optimizer that stepped (which parameters are in a group)
        self._forward_depth = 0
        self.step_dtypes: set[str] = set()
        self.graph_nodes = 0  # the most autograd nodes walked for one loss
        self.params: Optional[dict[str, Any]] = None  # name -> the parameter tensor
        self.params_start: Optional[dict[str, str]] = None
        self.params_end: Optional[dict[str, str]] = None
        self.distributed_samplers: list[list] = []  # [num_replicas, shuffle]
        self.batch_sizes: list[int] = []  # of every DataLoader iterated (samples per second, ``tune``)
        self.torch: Any = None
        self.pending: list[float] = []
        self.scaled: dict[int, float] = {}  # id(scaled loss) -> unscaled value
        self.optimizers: dict[int, int] = {}  # id(optimizer) -> index
        self.steps: list[list[dict]] = []  # per optimizer: [{"loss": x, "time_s": t}]
        self.last_time: Optional[float] = None
        self.backward_calls = 0
        self.grad_norm: Optional[float] = None
        self.no_grad = False  # the step about to run has parameters but no gradient
        self.clip_norm: Optional[float] = None  # the norm the last clip measured, before clipping
        self.clip_max: Optional[float] = None  # the norm the last clip clipped to
        self._stepped = False
        self.autocast: list[list] = []  # [device_type, dtype, enabled]
        #: what the training forwards computed in, read inside them: [device_type, dtype] of each
        #: autocast enabled where a module's forward began with gradients on ([None, "float32"]: none)
        self.forward_autocast: list[list] = []
        self.grad_scaler: list[list] = []  # [device, enabled]
        self.device: Optional[str] = None
        self.param_dtype: Optional[str] = None
        self.stopped = False
        self.error: Optional[str] = None
        self.written = False
        self._inside_backward = False
        self._last_snapshot = 0.0
        self._init_shards(config)  # several processes: their batches (harness_shards.py)

    # ---- installation ----------------------------------------------------------------------
    def boot(self) -> None:
        sys.meta_path.insert(0, _AfterImport("torch", self.install))
        previous_hook = sys.excepthook

        def excepthook(kind, value, tb):
            self.error = "".join(traceback.format_exception(kind, value, tb))
            previous_hook(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(self.write)
        try:
            previous = signal.getsignal(signal.SIGTERM)

            def on_term(signum, frame):
                # killed for a timeout: record the steps made, then die as SIGTERM would have
                self._snapshot()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            if previous == signal.SIG_DFL:  # a script's own handler (or SIG_IGN) stays
                signal.signal(signal.SIGTERM, on_term)
        except (ValueError, OSError):  # not the main thread of the main interpreter
            pass

    def install(self, torch) -> None:
        self.torch = torch
        self._seed_all(self.seed)
        if self.threads:
            torch.set_num_threads(int(self.threads))
        torch.Tensor.backward = self._wrap_backward(torch.Tensor.backward)
        torch.autograd.backward = self._wrap_backward(torch.autograd.backward)
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._on_step)
        self._hook_autocast(torch)
        self._hook_forward_autocast(torch)
        self._hook_grad_scaler(torch)
        self._hook_distributed_sampler(torch)
        self._hook_data_loader(torch)
        self._hook_clip(torch)
        self._hook_batch_norm(torch)
        if self.autocast_forward:
            self._hook_forward(torch, getattr(torch, self.autocast_forward))

    def _seed_all(self, seed: int) -> None:
        """torch, random and numpy seeded (at the start; again in the probe, harness_shards.py)."""
        import random

        random.seed(seed)
        self.torch.manual_seed(seed)
        try:
            import numpy

            numpy.random.seed(seed)
        except ImportError:
            pass

    def _wrap_backward(self, fn):
        recorder = self

        def backward(tensors, *args, **kwargs):
            if recorder._inside_backward:  # Tensor.backward calls torch.autograd.backward
                return fn(tensors, *args, **kwargs)
            recorder._record_loss(tensors)
            recorder._inside_backward = True
            try:
                return fn(tensors, *args, **kwargs)
            finally:
                recorder._inside_backward = False

        backward.__wrapped__ = fn
        backward.__doc__ = fn.__doc__
        return backward

    def _now(self) -> float:
        torch = self.torch
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _record_loss(self, tensors) -> None:
        torch = self.torch
        self.backward_calls += 1
        if self.last_time is None:
            self.last_time = self._now()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for t in tensors or ():
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                value = self.scaled.pop(id(t), None)
                self.pending.append(value if value is not None else float(t.detach().float().item()))
                if self.trace_precision:
                    self.step_dtypes |= self._half_dtypes(t)

    #: the autograd nodes walked at most for one loss (a graph this large has shown its dtypes)
    MAX_NODES = 200_000

    def _half_dtypes(self, loss) -> set[str]:
        """The half dtypes (float16, bfloat16) of the tensors in the graph that produced ``loss``:
        the evidence that the forward which fed this backward ran in low precision (under
        autocast, or with half weights). Read from each node's input metadata, before the
        backward frees the graph."""
        torch = self.torch
        half = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
        if loss.dtype in half:
            return {half[loss.dtype]}
        found: set[str] = set()
        seen: set = set()
        stack = [loss.grad_fn]
        while stack and len(seen) < self.MAX_NODES:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            try:
                for meta in node._input_metadata:
                    name = half.get(meta.dtype)
                    if name is not None:
                        found.add(name)
                stack.extend(fn for fn, _ in node.next_functions)
            except (AttributeError, RuntimeError):  # an older torch, a custom node
                continue
            if len(found) == 2 or self.trace_precision in found:  # what was asked for is there
                break
        self.graph_nodes = max(self.graph_nodes, len(seen))
        return found

    def _index(self, optimizer) -> int:
        """The optimizer's index, in the order they first step."""
        if id(optimizer) not in self.optimizers:
            self.optimizers[id(optimizer)] = len(self.optimizers)
            self._optimizer_refs.append(optimizer)
        return self.optimizers[id(optimizer)]

    def _where_call(self, what: str, optimizer=None, *args) -> None:
        """One of ``_Where``'s records, timed (its time is not the step's); a failure turns them off
        and is said in the record, never raised into the script."""
        if not self.where_on:
            return
        start = self._now()
        try:
            if self.where is None:
                self.where = _Where(self, optimizer)
            getattr(self.where, what)(*args)
        except Exception as exc:  # a sharded or exotic optimizer: its records are left out
            self.where_on, self.where = False, None
            self.where_error = f"{type(exc).__name__}: {exc}"
        self._where_s += self._now() - start

    def _before_step(self, optimizer, args, kwargs) -> None:
        """The gradient the step is about to apply (unscaled: GradScaler.step unscales first).
        A loss that an accumulating rewrite forgot to divide leaves the losses alone under
        Adam, but doubles this."""
        torch = self.torch
        if self._index(optimizer) == 0:
            self._where_call("before", optimizer)
        if self.track_params and self.params is None:
            self.params = self._model_parameters(optimizer)
            self.params_start = self._fingerprints()
        grads = [p.grad.detach().float() for group in optimizer.param_groups
                 for p in group["params"] if getattr(p, "grad", None) is not None]
        # parameters, none with a gradient: the step applies nothing (a zero_grad(set_to_none)
        # between the backward and the step); DeepSpeed keeps its gradients elsewhere
        self.no_grad = not grads and any(group["params"] for group in optimizer.param_groups) \
            and not type(optimizer).__module__.startswith("deepspeed")
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            self.grad_norm = float(norm.item())
        else:
            self.grad_norm = None

    def _on_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True
        # torch passes the step's own arguments with the optimizer first: (optimizer, closure)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self._index(optimizer) == 0 and self.where is not None:
            self._where_call("after")
        self._end_step(optimizer, closure)

    def _end_step(self, optimizer, closure, skipped: bool = False) -> None:
        index = self._index(optimizer)
        if index == 0 and self.where is not None:
            self._where_call("end_step", None, skipped, self.clip_max if self.clip_norm is not None else None)
        if index == len(self.steps):
            self.steps.append([])
        if closure is not None and self.pending:
            loss: Optional[float] = self.pending[0]  # LBFGS: the loss at the start of the step
        else:
            loss = sum(self.pending) if self.pending else None
        self.pending.clear()
        now = self._now()
        entry: dict = {"loss": loss, "grad_norm": None if skipped else self.grad_norm}
        if self.trace_precision:
            entry["half"] = sorted(self.step_dtypes)
            self.step_dtypes = set()
        if skipped:
            entry["skipped"] = True
        elif self.no_grad:
            entry["no_grad"] = True
        if self.clip_norm is not None:
            entry["clip_norm"] = self.clip_norm
            self.clip_norm = None
        if index == 0:
            entry["time_s"] = max(0.0, now - (self.last_time if self.last_time is not None else now) - self._where_s)
            self.last_time, self._where_s = now, 0.0
        self.steps[index].append(entry)
        if index == 0:
            self._after_step(len(self.steps[0]))
        if self.device is None:
            try:
                param = optimizer.param_groups[0]["params"][0]
                self.device, self.param_dtype = param.device.type, str(param.dtype).replace("torch.", "")
            except (IndexError, KeyError, AttributeError):
                pass
        if index == 0 and self.max_steps is not None and len(self.steps[0]) >= self.max_steps:
            self.stopped = True
            self.write()
            raise SystemExit(0)
        if index == 0 and time.monotonic() - self._last_snapshot >= SNAPSHOT_EVERY_S:
            self._snapshot()
            self.last_time = self._now()  # the write is not the next step's time

    # ---- the parameters (--freeze: frozen ones unchanged, the others moved) ---------------------
    def _unwrap(self, module):
        for _ in range(4):  # Fabric / DDP / compile wrappers
            names = self.WRAPPERS.get(type(module).__name__, ())
            inner = next((getattr(module, n) for n in names
                          if isinstance(getattr(module, n, None), self.torch.nn.Module)), None)
            if inner is None:
                break
            module = inner
        return module

    def _roots(self, wanted: list) -> list:
        """The model(s) that hold the parameters ``wanted`` (an optimizer's), unwrapped: the
        outermost modules (no other module's child), the one with the most of them first where
        several hold the same; then, while a model's parameters all sit in one child and none in
        itself, that child (a wrapper of the project's own). Each as (the outermost module's class,
        the module whose children are recorded, their path in it: "main.")."""
        import gc

        torch = self.torch
        modules = []
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.nn.Module):
                    modules.append(obj)
            except Exception:
                continue
        inner = {id(child) for m in modules for child in getattr(m, "_modules", {}).values() if child is not None}
        wanted_ids = {id(p) for p in wanted}
        tops, held = [], []
        for module in modules:
            if id(module) in inner:
                continue
            try:
                module = self._unwrap(module)
                ids = {id(p) for p in module.parameters()}
            except Exception:
                continue
            if ids & wanted_ids and all(module is not t for t in tops):
                tops.append(module)
                held.append(ids)
        roots, covered = [], set()
        for param in wanted:
            if id(param) in covered:
                continue
            holders = [k for k, ids in enumerate(held) if id(param) in ids]
            if not holders:
                continue
            best = max(holders, key=lambda k: (len(held[k] & wanted_ids), len(held[k])))
            roots.append(tops[best])
            covered |= held[best]
        out = []
        for root in roots:
            outer, path = type(root).__name__, ""
            for _ in range(8):
                children = [(n, c) for n, c in root.named_children() if next(c.parameters(), None) is not None]
                if len(children) != 1 or next(root.parameters(recurse=False), None) is not None:
                    break
                path, root = path + children[0][0] + ".", children[0][1]
            out.append((outer, root, path))
        return out

    WRAPPERS = {"_FabricModule": ("_forward_module", "_original_module"), "DistributedDataParallel": ("module",),
                "DataParallel": ("module",), "OptimizedModule": ("_orig_mod",),
                "FullyShardedDataParallel": ("_fsdp_wrapped_module", "module")}

    def _model_parameters(self, optimizer) -> dict[str, Any]:
        """Every parameter of the model the optimizer trains, by its name in the user's model (a
        wrapper's prefix taken off): the largest module that holds the optimizer's parameters,
        so that parameters left out of the optimizer (frozen) are in it too."""
        import gc

        torch = self.torch
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        best, best_count = None, -1
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.nn.Module):
                    continue
                module = obj
                for _ in range(4):  # unwrap Fabric / DDP / compile wrappers
                    names = self.WRAPPERS.get(type(module).__name__, ())
                    inner = next((getattr(module, n) for n in names
                                  if isinstance(getattr(module, n, None), torch.nn.Module)), None)
                    if inner is None:
                        break
                    module = inner
                params = dict(module.named_parameters())
            except Exception:
                continue
            if params and any(id(p) in wanted for p in params.values()) and len(params) > best_count:
                best, best_count = params, len(params)
        return best or {}

    def _fingerprints(self) -> dict[str, str]:
        import hashlib

        out = {}
        for name, param in (self.params or {}).items():
            try:
                data = param.detach().cpu().contiguous().view(self.torch.uint8).numpy().tobytes()
                out[name] = hashlib.blake2b(data, digest_size=12).hexdigest()
            except Exception:  # no numpy: a sum is not bitwise, but moves with any update
                out[name] = repr(float(param.detach().double().sum()))
        return out

    # ---- output ------------------------------------------------------------------------------
    def _rank_and_world(self) -> tuple[int, int]:
        torch = self.torch
        try:
            if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                return torch.distributed.get_rank(), torch.distributed.get_world_size()
        except Exception:
            pass
        env = os.environ
        rank = int(env.get("RANK", env.get("LOCAL_RANK", 0)))
        return rank, int(env.get("WORLD_SIZE", 1))

    def _peak_memory(self) -> tuple[int, str]:
        torch = self.torch
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated()), "cuda max allocated"
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS"

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        if self.track_params and self.params is not None:
            self.params_end = self._fingerprints()
        self._snapshot(final=True)

    def _where_record(self) -> Optional[dict]:
        if self.where is None:
            return {"error": self.where_error} if self.where_error else None
        try:
            return self.where.record(self._optimizer_refs)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _snapshot(self, final: bool = False) -> None:
        """Write what was recorded so far (the final write, at exit, or one during the run)."""
        self._last_snapshot = time.monotonic()
        rank, world = self._rank_and_world()
        memory, memory_kind = self._peak_memory()
        record = {
            "rank": rank,
            "world_size": world,
            "pid": os.getpid(),
            "torch_imported": self.torch is not None,
            "steps": self.steps[0] if self.steps else [],
            "other_optimizers": [[s["loss"] for s in steps] for steps in self.steps[1:]],
            "backward_calls": self.backward_calls,
            "peak_memory_bytes": memory,
            "memory_kind": memory_kind,
            "device": self.device,
            "param_dtype": self.param_dtype,
            "autocast": self.autocast,
            "forward_autocast": self.forward_autocast,
            "grad_scaler": self.grad_scaler,
            # Fabric ran the precision (its set-up modules' forwards), not the script's own autocast
            "fabric": any(name in sys.modules for name in ("lightning.fabric", "lightning_fabric")),
            "stopped_after_max_steps": self.stopped,
            "error": self.error,
            "exited": final,  # written by the atexit hook: the script's own code had finished
            "distributed_samplers": self.distributed_samplers,
            "batch_sizes": self.batch_sizes,
            "graph_nodes": self.graph_nodes,
            "params_start": self.params_start,
            "params_end": self.params_end,
            "where": self._where_record(),
            **self._shards_record(),
        }
        path = os.path.join(self.out_dir, f"rank{rank}-{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as handle:
                json.dump(record, handle)
            os.replace(path + ".tmp", path)
        except OSError:  # the run's folder is gone (the verifier gave up on this process)
            pass


def boot() -> None:
    """Called from sitecustomize in every process of a verified run."""
    config = os.environ.get(CONFIG_ENV)
    if not config:
        return
    Recorder(json.loads(config)).boot()
