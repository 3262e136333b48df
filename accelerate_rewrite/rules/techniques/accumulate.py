from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    CLIP_NORM,
    CLIP_VALUE,
    LOADER,
    OPTIMIZER,
    SCALER,
    SCHEDULER,
    BackwardSite,
    ScriptFacts,
    code,
)
from accelerate_rewrite.codemod.analysis.kinds import stepped_by
from accelerate_rewrite.codemod.analysis.libraries import LOSS_SCALERS
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.codemod.analysis.loops import data_source
from accelerate_rewrite.rules.base.plan import expr, short, stmt, visible_name
from accelerate_rewrite.rules.fabric._plan import plan

FLAG = "is_accumulating"
COUNTERS = ("batch_idx", "micro_step", "batch_index")


class Accumulate(Rule):
    """`--accumulate N`: accumulate the gradients of N micro-batches per optimizer step.

    What it does: in each training loop over a DataLoader (one optimizer, stepped right in
    the loop):
    - `is_accumulating = (i + 1) % N != 0 and i + 1 != len(loader)` at the top of the loop,
      with `i` the loop's own `enumerate` counter (one is added when the loop has none);
    - every backward gets the loss divided by the size of its group, N, or fewer for the last,
      partial group of an epoch: `(loss / min(N, len(loader) - i // N * N)).backward()`
      (likewise in `fabric.backward(...)` and `scaler.scale(...)`), so that every step
      applies the mean of its micro-batches' gradients, the last one of an epoch included;
    - the optimizer step and what belongs to it (clipping, `unscale_`, `scaler.update()`,
      a per-step `scheduler.step()`, a `zero_grad` after the step) go under
      `if not is_accumulating:`; a `zero_grad` before the backward runs at the first
      micro-batch of each group: `if i % N == 0:`. The last, partial group of an epoch is
      stepped too: no gradient is dropped, none is carried into the next epoch;
    - with Fabric (unless `--devices 1`), forward and backward go under
      `with fabric.no_backward_sync(model, enabled=is_accumulating):`, so that DDP reduces
      the gradients once per step, not once per micro-batch (on one device it does nothing);
    - with `--backend accelerate`, Accelerate's own accumulation instead:
      `Accelerator(gradient_accumulation_steps=N)`, forward and backward under
      `with accelerator.accumulate(model):`, the step and what belongs to it under
      `if accelerator.sync_gradients:` (a `zero_grad` between the forward and the backward moves
      to the top of the loop); Accelerate divides every loss by N, the last, partial group's
      too, and a program with a backward it can't put under `accumulate` is converted
      without accumulation (AR302 dropped, with the reason);
    - `--keep-effective-batch`: the DataLoader's `batch_size` (a number, or a name bound once
      to a number) is divided by N, so that each optimizer step sees as many samples as before.

    Why: a batch that does not fit in memory can still be the batch the optimizer sees.

    Kind: changes-training: each step sees N times more samples. With
    `--keep-effective-batch` (and a batch size the rewrite could divide) it is approximate:
    per optimizer step, the accumulated gradient is the mean over the same samples, for
    mean-reduced losses, summed in another order (fp32 rounding); it differs where the model
    uses batch statistics (BatchNorm), where dropout draws its masks per micro-batch, and
    where the last micro-batch of an epoch is smaller than the others (each micro-batch's mean
    weighs the same in its group's mean).

    Leaves alone (and says why): a script that already accumulates (a step under an `if`,
    backward in an inner micro-step loop, `no_sync` / `require_backward_grad_sync`), a loop
    that steps several optimizers (a GAN: the generator's backward leaves gradients in the
    discriminator that an accumulating discriminator would keep), steps with a closure
    (LBFGS), loops that are not over a DataLoader (the end of the epoch is unknown), and
    scripts that already use Fabric, the Trainer or Accelerate. A loop that can `break` is
    rewritten, with a note: a group cut short there is not stepped.
    """

    code = "AR302"
    name = "accumulate"
    kind = Kind.CHANGES_TRAINING
    examples = (
        Example.from_files("AR302", options={"accumulate": 4, "keep_effective_batch": True}),
        Example.from_files("AR302.torch", options={"backend": "torch", "precision": "16-mixed",
                                                   "accumulate": 4}),
    )

    def applies(self, options: Options) -> bool:
        return options.accumulate is not None

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        if f.frameworks:
            label, node = f.frameworks[0]
            ctx.skip(node, f"--accumulate: the script already uses {label}; accumulate with its API")
            return
        found = _existing(f)
        if found is not None:
            node, what = found
            ctx.skip(node, f"{what}: not accumulated twice")
            return
        loops: dict[int, list[cst.Call]] = {}
        order: list[cst.For] = []
        steps = f.method_calls(OPTIMIZER, "step") + [c for c in f.method_calls(SCALER, "step") if c.args]
        if not steps:
            ctx.skip(None, f"--accumulate: no optimizer step found{stepped_by(f)}")
            return
        for call in steps:
            loop = _loop_of(f, call)
            if loop is None:
                ctx.skip(call, f"`{short(call)}` is not in a loop: nothing to accumulate")
                continue
            if id(loop) not in loops:
                order.append(loop)
            loops.setdefault(id(loop), []).append(call)
        for loop in order:
            _Loop(ctx, loop, loops[id(loop)]).rewrite()


def _loop_of(f: ScriptFacts, node: cst.CSTNode) -> Optional[cst.For]:
    """The innermost ``for`` loop around ``node`` in its own function."""
    for parent in f.ancestors(node):
        if isinstance(parent, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            return None
        if isinstance(parent, (cst.For, cst.While)):
            return parent if isinstance(parent, cst.For) else None
    return None


def _existing(f: ScriptFacts) -> Optional[tuple[cst.CSTNode, str]]:
    """Where the script accumulates gradients on its own, if it does (or steps through a
    library's loss scaler, which steps at each call: it is asked to with its own keyword)."""
    for site in f.backward_sites:
        if site.library is not None:
            update = LOSS_SCALERS[site.library].update
            return site.call, (f"`{short(site.call)}` ({site.library}) runs backward and steps the optimizer at "
                               f"each call itself (its `{update}=` argument accumulates)")
    for call in f.attribute_calls:
        if call.func.attr.value in ("no_sync", "no_backward_sync"):
            return call, f"the script already accumulates gradients (`{short(call)}`)"
    for node in f.find(m.Attribute(attr=m.Name("require_backward_grad_sync"))):
        return node, "the script already accumulates gradients (`require_backward_grad_sync`)"
    for call in f.method_calls(OPTIMIZER, "step") + f.method_calls(SCALER, "step"):
        loop = _loop_of(f, call)
        if loop is None:
            continue
        for parent in f.ancestors(call):
            if parent is loop:
                break
            if isinstance(parent, cst.If):
                return parent, (f"`{short(call)}` runs under `if {code(parent.test)}:`: the script "
                                "already accumulates gradients, or steps on a schedule of its own")
        for site in f.backward_sites:
            inner = _loop_of(f, site.call)
            if inner is not None and inner is not loop and any(a is loop for a in f.ancestors(inner)):
                return inner, (f"the script already accumulates gradients (the backward runs in an "
                               f"inner loop, `for ... in {code(inner.iter)}:`, before `{short(call)}`)")
    return None


def _update_call(f: ScriptFacts, call: cst.Call) -> bool:
    """A call that belongs to the optimizer step: step, zero_grad, scheduler and scaler steps,
    clipping."""
    if isinstance(call.func, cst.Attribute):
        attr = call.func.attr.value
        kinds = f.kinds_of(call.func.value)
        if attr == "step" and kinds & {OPTIMIZER, SCALER, SCHEDULER}:
            return True
        if attr in ("update", "unscale_") and SCALER in kinds:
            return True
        if attr in ("zero_grad", "clip_gradients"):
            return True
    return bool(f.qualnames(call.func) & {*CLIP_NORM, *CLIP_VALUE})


def _int_value(f: ScriptFacts, node: cst.BaseExpression) -> Optional[int]:
    """A whole number written there, or a name bound once, in its scope, to one."""
    if isinstance(node, cst.Name):
        node = f.assigned_value(node)
    return int(node.evaluated_value) if isinstance(node, cst.Integer) else None


def _divided(node: cst.BaseExpression, divisor: str, receiver: bool) -> cst.BaseExpression:
    """``node / divisor``, in parentheses where it is the receiver of ``.backward()``."""
    left = node
    if not node.lpar and not isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
        left = node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    out = cst.BinaryOperation(left, cst.Divide(), expr(divisor))
    return out.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()]) if receiver else out


def _runs(body: list[cst.BaseStatement], indices: list[int]) -> list[list[cst.BaseStatement]]:
    """The statements of ``body`` at ``indices``, in runs of consecutive ones."""
    runs: list[list[cst.BaseStatement]] = []
    for index in indices:
        if runs and body.index(runs[-1][-1]) == index - 1:
            runs[-1].append(body[index])
        else:
            runs.append([body[index]])
    return runs


def _if(test: str, body: list[cst.BaseStatement]) -> cst.If:
    return cst.If(test=expr(test), body=cst.IndentedBlock(body=body))


@dataclass
class _Loop:
    ctx: RuleContext
    loop: cst.For
    steps: list[cst.Call]
    notes: list[str] = field(default_factory=list)

    def skip(self, node: Optional[cst.CSTNode], why: str) -> None:
        self.ctx.skip(node or self.loop, why)

    def top(self, node: cst.CSTNode) -> Optional[cst.BaseStatement]:
        """The statement of the loop's own body that holds ``node``."""
        body = self.loop.body
        current = node
        for parent in self.ctx.facts.ancestors(node):
            if parent is body:
                return current
            current = parent
        return None

    def rewrite(self) -> None:
        f, o, loop = self.ctx.facts, self.ctx.options, self.loop
        n = o.accumulate
        head = f"`for ... in {short(loop.iter)}:`"
        optimizers = {code(c.args[0].value) if f.is_kind(c.func.value, SCALER) else code(c.func.value)
                      for c in self.steps}
        if len(optimizers) > 1:
            return self.skip(loop, f"the loop {head} steps {len(optimizers)} optimizers (a GAN?): "
                                   "accumulating one would keep gradients the other model's loss left "
                                   "in it; not accumulated")
        step = self.steps[0]
        scaler_step = f.is_kind(step.func.value, SCALER)
        if (len(step.args) > (1 if scaler_step else 0)):
            return self.skip(step, f"`{short(step)}` steps with a closure: not accumulated")
        step_stmt = f.statement(step)
        body = list(loop.body.body)
        if step_stmt not in body:
            return self.skip(step, f"`{short(step)}` is not directly in the loop's body: not accumulated")
        sites = [s for s in f.backward_sites if _loop_of(f, s.call) is loop]
        if not sites:
            return self.skip(step, f"no backward in the loop {head}: not accumulated")
        tops = [self.top(s.call) for s in sites]
        if any(t is None or body.index(t) > body.index(step_stmt) for t in tops):
            return self.skip(step, f"a backward after `{short(step)}` in the loop: not accumulated")
        first, last = min(body.index(t) for t in tops), max(body.index(t) for t in tops)
        loader = data_source(f, loop.iter)
        if not (isinstance(loader, (cst.Name, cst.Attribute)) and f.is_kind(loader, LOADER)):
            return self.skip(loop, f"the loop {head} is not over a DataLoader the rewrite can measure: "
                                   "where an epoch ends (its last, partial group) is unknown; not accumulated")
        counter, start = self._counter()
        if counter is False:
            return
        updates = []  # statements of the step, after the backward
        for index, s in enumerate(body):
            if index <= first or s in tops:
                continue
            if any(_update_call(f, c) for c in m.findall(s, m.Call())):
                if index < last:
                    return self.skip(s, f"`{short(s)}` runs between two backwards: not accumulated")
                updates.append(index)
        early = []  # zero_grad (or a scheduler step) before the first backward
        for s in body[:first]:
            calls = [c for c in m.findall(s, m.Call()) if _update_call(f, c)]
            if calls:
                if not isinstance(s, cst.SimpleStatementLine):
                    return self.skip(s, f"`{short(calls[0])}` runs inside `{short(s)}` before the "
                                        "backward: not accumulated")
                early.append(s)
        for s in tops:
            if s is not None and not isinstance(s, cst.SimpleStatementLine) and any(
                    _update_call(f, c) for c in m.findall(s, m.Call())):
                return self.skip(s, f"`{short(s)}` holds the backward and a step: not accumulated")

        if o.accelerate and plan(f, o).refusal is None:  # else the loop stays torch's, as with Fabric
            return self._accelerate(body, first, last, early, updates, step, loader, head)

        # ---- edits ----
        edits = self.ctx.edits
        i = counter or self._fresh(COUNTERS)
        if counter is None:
            self._add_counter(i)
            start = 0
        position = i if start == 1 else f"{i} + {1 - start}" if start < 1 else f"{i} - {start - 1}"
        flag = FLAG
        first_line = stmt(f"{flag} = {f'({position})' if ' ' in position else position} % {n} != 0 "
                          f"and {position} != len({code(loader)})\n")
        # put on top of the loop's body once everything in it is done (not inside a wrap)
        edits.replace(loop, lambda u, s=first_line: u.with_changes(
            body=u.body.with_changes(body=[s, *u.body.body])))
        group_start = f"{i} % {n} == 0" if start == 0 else f"({i} - {start}) % {n} == 0"
        for s in early:
            edits.replace(s, lambda u, t=group_start: _if(t, [u.with_changes(leading_lines=[])]).with_changes(
                leading_lines=u.leading_lines))
        runs = _runs(body, updates)
        for run in runs:
            edits.wrap(run, lambda inner, t=f"not {flag}": _if(t, inner))
        apex = apex_use(f).blocks
        # each group's own size: N, or what is left of the epoch for its last, partial group
        index = i if start == 0 else f"({i} - {start})"
        divisor = f"min({n}, len({code(loader)}) - {index} // {n} * {n})"
        for site in sites:
            self._divide(site, apex, divisor)
        self._sync(body, first, last, step, head)
        batch_kind = self._batch(loader)
        moved = [code(c.func.value) for s in [*early, *(body[k] for k in updates)]
                 for c in m.findall(s, m.Call()) if isinstance(c.func, cst.Attribute)
                 and c.func.attr.value == "step" and f.is_kind(c.func.value, SCHEDULER)]
        if moved:
            self.notes.append(f"`{moved[0]}.step()` now runs once per optimizer step: a schedule "
                              f"sized in batches runs {n} times slower")
            sized = [c for c in f.find(m.Call(func=m.Name("len"), args=[m.Arg()]))
                     if f.same_object(f.key_of(c.args[0].value), f.key_of(loader))
                     and not any(a is loop for a in f.ancestors(c))]
            if sized and batch_kind is Kind.APPROXIMATE:
                batch_kind = Kind.CHANGES_TRAINING
                self.notes.append(f"`{short(sized[0])}` (line {f.line(sized[0])}) now counts micro-batches")
        breaks = [b for b in m.findall(loop.body, m.Break() | m.Continue()) if _loop_of(f, b) is loop]
        if breaks:
            self.notes.append(f"the loop can `{'break' if isinstance(breaks[0], cst.Break) else 'continue'}` "
                              f"(line {f.line(breaks[0])}): a group cut short there is not stepped")
        extra = "; ".join(self.notes)
        self.ctx.change(loop, f"gradients accumulated over {n} micro-batches in the loop {head}: "
                              f"`{short(step)}` every {n} batches and at the end of the epoch"
                              + (f"; {extra}" if extra else ""), kind=batch_kind)

    def _accelerate(self, body, first: int, last: int, early: list, updates: list[int], step: cst.Call,
                    loader: cst.BaseExpression, head: str) -> None:
        """``--backend accelerate``: Accelerate's own accumulation. From the forward to the last
        backward, the loop's body runs under ``with fabric.accumulate(model):`` (spelled
        ``accelerator.accumulate``; ``Accelerator(gradient_accumulation_steps=N)``), which counts
        the micro-batches and sets ``sync_gradients`` at the end of each group (and where the
        prepared loader ends); the step and what belongs to it go under
        ``if fabric.sync_gradients:`` (the prepared optimizer would skip its own step and
        zero_grad, a scheduler's step and clipping it would not). Accelerate divides every
        backward by N, the last, partial group's too (its own rule: that group's gradient is its
        sum over N, not its mean)."""
        f, o = self.ctx.facts, self.ctx.options
        n = o.accumulate
        p = plan(f, o)
        ref = p.ref_at(f, self.loop)
        optimizer = step.args[0].value if f.is_kind(step.func.value, SCALER) else step.func.value
        built = next((b for b in f.optimizers if f.same_object(b.key, f.key_of(optimizer))), None)
        model = visible_name(f, self.loop, built.models[0]) if built is not None and len(built.models) == 1 \
            else None
        if ref is None or model is None or not p.group_of(f, built.models[0]):
            return self.skip(step, f"`{short(step)}`: the model that `accelerator.accumulate(...)` takes can't be "
                                   "named here; not accumulated")
        start = next((k for k in range(first + 1) if any(
            f.same_object(f.key_of(c.func), built.models[0])
            or any(f.same_object(f.key_of(a.value), built.models[0]) for a in c.args)
            for c in m.findall(body[k], m.Call()))), None)
        if start is None:
            return self.skip(step, f"no call of `{model}` before the backward in the loop {head}: "
                                   "not accumulated")
        def plain(s: cst.BaseStatement) -> bool:  # what the prepared optimizer skips itself
            calls = [c for c in m.findall(s, m.Call()) if _update_call(f, c)]
            return all(isinstance(c.func, cst.Attribute) and c.func.attr.value in ("step", "zero_grad")
                       and f.is_kind(c.func.value, OPTIMIZER) for c in calls)

        # a zero_grad between the forward and the backward (``loss = ...; optimizer.zero_grad();
        # loss.backward()``) moves to the top of the loop: under ``accumulate`` it would clear the
        # group's gradients just before its last backward (the forward makes none)
        moved_up = [s for s in early if body.index(s) >= start]
        for s in moved_up:
            if not (plain(s) and m.matches(s, m.SimpleStatementLine(body=[m.Expr(m.Call(
                    func=m.Attribute(attr=m.Name("zero_grad"))))]))):
                return self.skip(s, f"`{short(s)}` runs between the forward and the backward: not accumulated")
        edits = self.ctx.edits
        guarded = f"{ref}.sync_gradients"
        for s in moved_up:
            edits.remove(s)
            self.notes.append(f"`{short(s)}` moved from between the forward and the backward (line {f.line(s)}) "
                              "to the top of the loop, so that it clears the gradients before a group, not "
                              "inside it")
        if moved_up:
            top = _if(guarded, [s.with_changes(leading_lines=[]) for s in moved_up])
            edits.replace(self.loop, lambda u, t=top: u.with_changes(body=u.body.with_changes(body=[t, *u.body.body])))
        for s in early:  # at the top of the loop: the last micro-batch's (the group before) was stepped
            if s not in moved_up:
                edits.replace(s, lambda u, t=guarded: _if(t, [u.with_changes(leading_lines=[])]).with_changes(
                    leading_lines=u.leading_lines))
        runs = _runs(body, updates)
        for run in runs:
            edits.wrap(run, lambda inner, t=guarded: _if(t, inner))
        edits.wrap(body[start:last + 1], lambda inner, r=ref, md=model: cst.With(
            items=[cst.WithItem(expr(f"{r}.accumulate({md})"))], body=cst.IndentedBlock(body=inner)))
        batch_kind = self._batch(loader)
        moved = [code(c.func.value) for s in [*early, *(body[k] for k in updates)]
                 for c in m.findall(s, m.Call()) if isinstance(c.func, cst.Attribute)
                 and c.func.attr.value == "step" and f.is_kind(c.func.value, SCHEDULER)]
        if moved:
            self.notes.append(f"`{moved[0]}.step()` now runs once per optimizer step: a schedule "
                              f"sized in batches runs {n} times slower")
        breaks = [b for b in m.findall(self.loop.body, m.Break()) if _loop_of(f, b) is self.loop]
        if breaks:
            self.notes.append(f"the loop can `break` (line {f.line(breaks[0])}): a group cut short there "
                              "is not stepped")
        self.notes.append(f"Accelerate divides each loss by {n}, the last, partial group's of an epoch too "
                          "(Accelerate's own rule: that step applies the sum of its micro-batches' "
                          f"gradients over {n}, not their mean)")
        self.ctx.change(self.loop, f"gradients accumulated over {n} micro-batches in the loop {head} with "
                                   f"`{ref}.accumulate({model})`: `{short(step)}` every {n} batches and at the "
                                   "end of the epoch; " + "; ".join(self.notes), kind=batch_kind)

    def _counter(self) -> tuple[Union[str, None, bool], int]:
        """The loop's own ``enumerate`` counter and start, (None, 0) when it has none, or
        (False, 0) after a skip."""
        loop, f = self.loop, self.ctx.facts
        it = loop.iter
        if m.matches(it, m.Call(func=m.Name("enumerate"))):
            start_arg = it.args[1].value if len(it.args) > 1 else next(
                (a.value for a in it.args if a.keyword and a.keyword.value == "start"), None)
            start = 0 if start_arg is None else _int_value(f, start_arg)
            target = loop.target
            name = target.elements[0].value if isinstance(target, cst.Tuple) and target.elements else None
            if start is None or not isinstance(name, cst.Name):
                self.skip(loop, f"the counter of `{short(it)}` can't be read: not accumulated")
                return False, 0
            if name.value == "_":
                new = self._fresh(COUNTERS)
                self.ctx.edits.replace(name, cst.Name(new))
                return new, start
            return name.value, start
        return None, 0

    def _fresh(self, names: tuple[str, ...]) -> str:
        used = {n.value for n in self.ctx.facts.find(m.Name())}
        for name in names:
            if name not in used:
                return name
        k = 2
        while f"{names[0]}_{k}" in used:
            k += 1
        return f"{names[0]}_{k}"

    def _add_counter(self, name: str) -> None:
        def change(u: cst.For) -> cst.For:
            target = u.target
            if isinstance(target, cst.Tuple) and not target.lpar:
                target = target.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            new_target = cst.Tuple([cst.Element(cst.Name(name)), cst.Element(target)], lpar=[], rpar=[])
            return u.with_changes(target=new_target, iter=cst.Call(cst.Name("enumerate"), [cst.Arg(u.iter)]))
        self.ctx.edits.replace(self.loop, change)

    def _divide(self, site: BackwardSite, apex: dict, divisor: str) -> None:
        f = self.ctx.facts
        if id(site.call) in apex:  # ``with amp.scale_loss(loss, opt) as s: s.backward()``
            target, receiver = apex[id(site.call)][1], False
        elif m.matches(site.loss, m.Call(func=m.Attribute(attr=m.Name("scale")), args=[m.Arg()])) \
                and f.is_kind(site.loss.func.value, SCALER):
            target, receiver = site.loss.args[0].value, False  # the script's own scaler.scale(loss)
        else:
            target, receiver = site.loss, True
        self.ctx.edits.replace(target, lambda u, r=receiver: _divided(u, divisor, r))

    def _sync(self, body, first: int, last: int, step: cst.Call, head: str) -> None:
        """Fabric: forward and backward of a micro-batch that does not step under
        ``no_backward_sync``."""
        f, o = self.ctx.facts, self.ctx.options
        if not o.fabric or o.single_device:
            return
        p = plan(f, o)
        if p.refusal is not None:
            return
        ref = p.ref_at(f, self.loop)
        optimizer = step.args[0].value if f.is_kind(step.func.value, SCALER) else step.func.value
        built = next((b for b in f.optimizers if f.same_object(b.key, f.key_of(optimizer))), None)
        model = visible_name(f, self.loop, built.models[0]) if built is not None and len(built.models) == 1 \
            else None
        if ref is None or model is None or not p.group_of(f, built.models[0]):
            self.notes.append("not under `no_backward_sync` (the model set up with Fabric can't be "
                              "named here): the gradients are reduced every micro-batch")
            return
        model_key = built.models[0]
        start = next((k for k in range(first + 1) if any(
            f.same_object(f.key_of(c.func), model_key) or any(f.same_object(f.key_of(a.value), model_key)
                                                           for a in c.args)
            for c in m.findall(body[k], m.Call()))), None)
        if start is None:
            self.notes.append(f"not under `no_backward_sync` (no call of `{model}` found before the "
                              "backward): the gradients are reduced every micro-batch")
            return
        self.ctx.edits.wrap(body[start:last + 1], lambda inner, r=ref, md=model: cst.With(
            items=[cst.WithItem(expr(f"{r}.no_backward_sync({md}, enabled={FLAG})"))],
            body=cst.IndentedBlock(body=inner)))

    def _batch(self, loader: cst.BaseExpression) -> Kind:
        """``--keep-effective-batch``: the loader's batch_size divided by N. The kind of the change."""
        f, o = self.ctx.facts, self.ctx.options
        n = o.accumulate
        binding = next((b for b in f.loaders if f.same_object(b.key, f.key_of(loader))), None)
        call = binding.call if binding is not None else None
        arg = None
        if call is not None:
            arg = next((a for a in call.args if a.keyword and a.keyword.value == "batch_size"), None)
            if arg is None and len(call.args) > 1 and call.args[1].keyword is None and not call.args[1].star:
                arg = call.args[1]
        value = _int_value(f, arg.value) if arg is not None else None
        if not o.keep_effective_batch:
            size = f" ({value} -> {value * n} samples)" if value else ""
            self.notes.append(f"the effective batch is {n} times larger{size}")
            return Kind.CHANGES_TRAINING
        if value is None:
            what = f"`{code(arg.value)}`" if arg is not None else "not given in the DataLoader(...) call"
            self.notes.append(f"--keep-effective-batch: the batch size ({what}) can't be resolved "
                              f"statically, so it is left as is: the effective batch is {n} times larger; "
                              f"divide the batch size by {n} yourself")
            return Kind.CHANGES_TRAINING
        if value % n:
            self.notes.append(f"--keep-effective-batch: batch_size {value} is not divisible by {n}: "
                              f"left as is; the effective batch is {n} times larger")
            return Kind.CHANGES_TRAINING
        if isinstance(arg.value, cst.Integer):
            self.ctx.edits.replace(arg.value, cst.Integer(str(value // n)))
        else:
            self.ctx.edits.replace(arg.value, lambda u: cst.BinaryOperation(u, cst.FloorDivide(),
                                                                            cst.Integer(str(n))))
        self.notes.append(f"batch_size {value} -> {value // n} keeps the effective batch at {value}")
        return Kind.APPROXIMATE
