"""Where two runs part (issue 48), the in-process side: per step of the first optimizer, the
gradient norm and the update size of each of its parameter groups and of each top-level module
of the model(s) it trains. Part of the harness (harness.py), loaded from its file as the harness
is: only the standard library is imported here, torch is the recorder's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from accelerate_rewrite.verify.harness import Recorder


def _plain(value: Any) -> Any:
    """A parameter group's setting as JSON can hold it (a 0-d tensor as its float), or _SKIP."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    numel = getattr(value, "numel", None)
    if callable(numel):
        try:
            if numel() == 1:
                return float(value)
        except Exception:
            pass
    return _SKIP


_SKIP = object()


class Where:
    """Where two runs part (issue 48): per step of the first optimizer, the gradient norm and the
    update size (the norm of the change the step made) of each of its parameter groups and of each
    top-level module of the model(s) it trains (their ``named_children()``; a parameter of the
    model itself counts as a module of its own), and each group's learning rate; at the first
    step, each group's settings (lr, weight_decay, betas, eps, momentum, ...), and the parameters
    with ``requires_grad`` False. Norms only: the update is measured against a copy of the
    parameters on the CPU, made just before the step and dropped right after it (none where they
    hold more than ``COPY_MAX_BYTES``)."""

    COPY_MAX_BYTES = 1 << 30

    def __init__(self, recorder: "Recorder", optimizer) -> None:
        self.torch = recorder.torch
        self.optimizer_type = type(optimizer).__name__
        groups = optimizer.param_groups
        wanted = [p for group in groups for p in group["params"]]
        roots = recorder._roots(wanted)
        self.modules: list[str] = []
        self.types: list[str] = []  # each module's class ("Parameter": a parameter of the model itself)
        self.params: list = []  # the parameters recorded (references, never copies)
        self.names: list[str] = []  # their names in the user's model
        self.module_of: list[int] = []  # their module's index in ``modules``
        seen: dict[int, int] = {}
        classes = self.models = [outer for outer, _, _ in roots]
        for k, (_, root, path) in enumerate(roots):
            prefix = path
            if len(roots) > 1:  # several models trained by one optimizer: each named by its class
                twin = f"[{classes[:k].count(classes[k])}]" if classes.count(classes[k]) > 1 else ""
                prefix = f"{classes[k]}{twin}.{path}"
            children = dict(root.named_children())
            for name, param in root.named_parameters():
                if id(param) in seen:
                    continue
                head = name.split(".", 1)[0]
                module = prefix + (head if head in children else name)
                if module not in self.modules:
                    self.modules.append(module)
                    self.types.append(type(children[head]).__name__ if head in children else "Parameter")
                seen[id(param)] = len(self.params)
                self.params.append(param)
                self.names.append(prefix + name)
                self.module_of.append(self.modules.index(module))
        self.groups: list[list[int]] = []
        for g, group in enumerate(groups):
            positions = []
            for j, param in enumerate(group["params"]):
                if id(param) not in seen:  # a tensor of no module the verifier found
                    seen[id(param)] = len(self.params)
                    self.params.append(param)
                    self.names.append(f"param_groups[{g}][{j}]")
                    self.module_of.append(-1)
                positions.append(seen[id(param)])
            self.groups.append(positions)
        self.settings = [{k: v for k, v in ((k, _plain(v)) for k, v in group.items() if k != "params")
                          if v is not _SKIP} for group in groups]
        self.frozen = [i for i, p in enumerate(self.params) if not p.requires_grad]
        self.copy = sum(p.numel() * p.element_size() for p in self.params) <= self.COPY_MAX_BYTES
        self.optimizer = optimizer
        self.steps: list[Optional[dict]] = []
        self.pending: Optional[dict] = None
        self.before_copy: Optional[list] = None

    def _sums(self, values: dict[int, float]) -> tuple[list, list]:
        """Per module and per group, the norm over the parameters that have a value (None: none has)."""
        modules: list[Optional[float]] = [None] * len(self.modules)
        for i, v in values.items():
            m = self.module_of[i]
            if m >= 0:
                modules[m] = (modules[m] or 0.0) + v * v
        groups: list[Optional[float]] = []
        for positions in self.groups:
            present = [values[i] for i in positions if i in values]
            groups.append(sum(v * v for v in present) if present else None)
        root = self._root
        return [root(x) for x in modules], [root(x) for x in groups]

    @staticmethod
    def _root(x: Optional[float]) -> Optional[float]:
        return None if x is None else x ** 0.5

    def _norms(self, tensors: dict[int, Any]) -> dict[int, float]:
        torch = self.torch
        if not tensors:
            return {}
        keys = list(tensors)
        norms = [torch.linalg.vector_norm(tensors[i], dtype=torch.float32).to("cpu") for i in keys]
        return dict(zip(keys, torch.stack(norms).tolist()))

    def before(self) -> None:
        grads = {i: p.grad.detach() for i, p in enumerate(self.params)
                 if getattr(p, "grad", None) is not None and not p.grad.is_sparse}
        grad_modules, grad_groups = self._sums(self._norms(grads))
        self.pending = {"g": grad_modules, "gg": grad_groups}
        self.before_copy = [p.detach().to("cpu", copy=True) for p in self.params] if self.copy else None

    def after(self) -> None:
        if self.pending is None:
            return
        if self.before_copy is not None:
            torch = self.torch
            with torch.no_grad():
                changes = {i: p.detach().float() - b.to(p.device).float()
                           for i, (p, b) in enumerate(zip(self.params, self.before_copy))}
                update_modules, update_groups = self._sums(self._norms(changes))
            self.pending.update(u=update_modules, gu=update_groups)
        self.before_copy = None

    def end_step(self, skipped: bool, clip_max: Optional[float] = None) -> None:
        entry = None if skipped else self.pending
        if entry is not None:
            if clip_max is not None:
                entry["clip_max"] = clip_max
            lrs = []
            for group in self.optimizer.param_groups:
                value = _plain(group.get("lr"))
                lrs.append(value if isinstance(value, (int, float)) else None)
            entry["lr"] = lrs
        self.steps.append(entry)
        self.pending, self.before_copy = None, None

    def record(self, optimizers: list) -> dict:
        in_group = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}

        def by_module(positions) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for i in positions:
                if self.module_of[i] >= 0:
                    out.setdefault(self.modules[self.module_of[i]], []).append(self.names[i])
            return out

        return {
            "optimizer": self.optimizer_type,
            "models": self.models,
            "modules": self.modules,
            "module_types": self.types,
            "groups": [{"settings": settings, "params": len(positions),
                        "modules": list(dict.fromkeys(self.modules[self.module_of[i]] for i in positions
                                                      if self.module_of[i] >= 0))}
                       for settings, positions in zip(self.settings, self.groups)],
            "frozen": by_module(self.frozen),
            "no_group": by_module(i for i, p in enumerate(self.params) if id(p) not in in_group),
            "updates_measured": self.copy,
            "steps": self.steps,
        }
