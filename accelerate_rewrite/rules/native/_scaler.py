"""The native plan's GradScaler (16-mixed, ``--backend torch``): where the one
``torch.amp.GradScaler`` of the run is created (after the optimizers are built, or after
``self.optimizer = ...`` in a class that steps it), how every backward, clip and optimizer step
reaches it (threaded into a function that needs it), one ``update()`` per iteration, and
``unscale_`` before a clip. Part of rules/native/_plan.py's planner (``Scaler`` is a mixin of it: it
reads ``self.f``, ``self.p``, ``self.steps`` and ``self.device_type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import CLIP_NORM, CLIP_VALUE, code
from accelerate_rewrite.codemod.analysis.syntax import is_main_guard
from accelerate_rewrite.rules.base.plan import common_after, short



@dataclass
class Site:
    """A backward: ``loss.backward()``, or apex's ``with amp.scale_loss(loss, opt) as s:
    s.backward()`` (then ``stmt`` is the ``with`` and ``apex`` is true)."""

    call: cst.Call  # the ``.backward(...)`` call
    loss: cst.BaseExpression
    stmt: cst.BaseStatement  # the statement in the training block
    apex: bool = False

SCALER = "scaler"


class Scaler:
    """The planner's part that places the GradScaler."""

    # -- 16-mixed: one GradScaler --
    def _scaler(self, sites: list[Site]) -> None:
        f, p = self.f, self.p
        if not self.steps:
            self.refuse(sites[0].call, f"`{short(sites[0].call)}`: no `optimizer.step()` found for a GradScaler to "
                                       "step (the parameters are updated by hand, or by a wrapper's own method)")
            return
        for call in self.steps:
            if call.args:
                self.refuse(call, f"`{short(call)}` takes arguments (a closure): a GradScaler "
                                  "can't step it")
                return
        for opt in f.optimizers:
            guard = f.parent(f.block(opt.stmt))
            if is_main_guard(guard) and isinstance(f.parent(guard), cst.Module):
                continue  # the script's main block: it runs whenever the script does
            if isinstance(guard, cst.If) and not any(
                    o is not opt and o.path == opt.path and guard in f.ancestors(o.stmt) for o in f.optimizers):
                # bound on one path only: the scaler's calls next to its steps would read it where
                # the engine can't show it bound (and a scaled backward on the other path steps by hand)
                self.refuse(opt.stmt, f"`{opt.path}` is built only under `if {short(guard.test)}:`: "
                                      "the GradScaler's steps can't be shown to find it; convert by hand, "
                                      "or use --backend fabric (it sets the model up on both paths)")
                return
        if not self._scaler_home():
            return
        for site in sites:
            ref = self._scaler_ref(site.call)
            if ref is None:
                return
            p.backwards.append((site, ref))
        last_in_block: dict[int, cst.BaseStatement] = {}
        for call in self.steps:
            ref = self._scaler_ref(call)
            if ref is None:
                return
            p.steps.append((call, ref))
            s = f.statement(call)
            block = f.block(s)
            previous = last_in_block.get(id(block))
            if previous is None or f.line(s) > f.line(previous):
                last_in_block[id(block)] = s
        # one update per iteration, after the last optimizer stepped in that block (a GAN's two)
        p.updates = [(s, self._scaler_ref(s)) for s in last_in_block.values()]
        self._unscales()

    def _scaler_home(self) -> bool:
        """Where the scaler is created: after the optimizers are built (or, in a class whose
        methods step ``self.optimizer``, after ``self.optimizer = ...``)."""
        f, p = self.f, self.p
        receivers = [call.func.value for call in self.steps]
        on_self = [r for r in receivers if m.matches(r, m.Attribute(value=m.Name("self")))]
        attrs = {code(r) for r in on_self}
        if attrs:
            if len(on_self) != len(receivers):
                self.refuse(self.steps[0], "optimizers stepped both as `self.` attributes and as "
                                           "plain names: can't place one GradScaler for both")
                return False
            cls = f.enclosing_class(f.function(self.steps[0]))
            # ``self.optimizer = None`` in __init__ only declares it (minGPT's Trainer)
            assigns = [a for a in m.findall(cls, m.Assign()) if len(a.targets) == 1
                       and code(a.targets[0].target) in attrs
                       and not m.matches(a.value, m.Name("None"))] if cls is not None else []
            if cls is None or not assigns:
                self.refuse(self.steps[0], "could not find where the optimizer attribute is set")
                return False
            after = common_after(f, [f.statement(a) for a in assigns])
            if after is None or any(isinstance(a, (cst.For, cst.While)) for a in f.ancestors(after)
                                    if f.function(a) is f.function(after)):
                self.refuse(assigns[0], "the optimizer attribute is set in more than one place: "
                                        "can't place one GradScaler for it")
                return False
            p.scaler_after, p.scaler_target = after, f"self.{SCALER}"
            self.home_class = cls
        else:
            keys = [f.key_of(r) for r in receivers]
            built = [o for o in f.optimizers if any(f.same_object(o.key, k) for k in keys)]
            if not built:
                self.refuse(self.steps[0], "could not find where the optimizer is built")
                return False
            after = common_after(f, [o.stmt for o in built])
            if after is None:
                self.refuse(built[-1].stmt, "the optimizers are built in different functions: "
                                            "can't place one GradScaler for them")
                return False
            p.scaler_after = after
            self.home_class = None
        self.home = f.function(p.scaler_after) or f.module
        device_type = self.device_type(p.scaler_after)
        if device_type is None:
            self.refuse(p.scaler_after, "can't tell which device the script runs on where the "
                                        "GradScaler goes")
            return False
        taken = [n for n in f.find(m.Name(SCALER)) if f.key_of(n) is not None]
        if taken:
            self.refuse(taken[0], f"the name `{SCALER}` is already used in this script")
            return False
        p.scaler_device_type = device_type
        return True

    def _scaler_ref(self, node: cst.CSTNode) -> Optional[str]:
        """How the scaler is named where ``node`` stands; threads it into a function if needed."""
        f, p = self.f, self.p
        func = f.function(node)
        if self.home_class is not None:
            if func is not None and f.enclosing_class(func) is self.home_class:
                return p.scaler_target
        elif func is self.home or (func is None and self.home is f.module):
            if f.line(node) > f.line(p.scaler_after):
                return SCALER
        elif self.home is f.module:
            return SCALER  # a global, created before the training code runs
        elif func is not None and func.name.value in f.functions \
                and f.functions[func.name.value].node is func:
            fn = f.functions[func.name.value]
            if fn.calls and not fn.other_uses and all(
                f.function(c) is self.home and f.line(c) > f.line(p.scaler_after) for c in fn.calls
            ):
                if func not in p.threads:
                    p.threads.append(func)
                    p.thread_calls.extend(fn.calls)
                return SCALER
        self.refuse(node, f"`{short(node)}` can't reach the GradScaler, which is created after "
                          f"line {f.line(p.scaler_after)} (it would have to be passed through more "
                          "than one function)")
        return None

    def _unscales(self) -> None:
        """A clip between the backward and the step clips unscaled gradients: unscale_ first."""
        f, p = self.f, self.p
        for site in f.calls_to(*CLIP_NORM, *CLIP_VALUE):
            clip = f.statement(site.call)
            body = list(f.block(clip).body)
            later = [c for c in self.steps if f.statement(c) in body[body.index(clip) + 1:]]
            guard = f.parent(f.block(clip))
            if not later and isinstance(guard, cst.If) and f.block(clip) is guard.body:
                # ``if max_norm > 0: clip_grad_norm_(...)`` and the step after that ``if``
                # (DETR's train_one_epoch): unscaled inside it, where it clips
                outer = list(f.block(guard).body)
                later = [c for c in self.steps if f.statement(c) in outer[outer.index(guard) + 1:]]
            if not later:
                self.refuse(site.call, f"`{short(site.call)}` has no optimizer step after it in "
                                       "the same block: can't tell which optimizer to unscale")
                return
            ref = self._scaler_ref(clip)
            if ref is None:
                return
            p.unscales.append((clip, ref, code(later[0].func.value)))

