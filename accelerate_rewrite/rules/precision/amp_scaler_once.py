from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import SCALER
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.plan import short


class ScalerOnce(Rule):
    """One GradScaler per run: a GradScaler created inside the training loop moves out of it.

    What it does: `scaler = torch.amp.GradScaler(...)` built inside a loop (typically the epoch
    loop) moves to just before the outermost loop it is in, in the same function.

    Why: the scaler learns its scale over the steps (it starts at 65,536, halves on every
    overflow and grows back slowly); a new one every epoch throws that away and overflows again
    at the start of each epoch, skipping those steps.

    Kind: changes-training (a fix: with the scaler disabled nothing changes; with it enabled
    the steps a fresh scaler skipped at each epoch's start are taken).

    Leaves alone (and says why): a scaler whose arguments use names the loop sets (the loop
    variable, ...), or that is not a plain `name = GradScaler(...)` statement.
    """

    code = "AR203"
    fix = True
    name = "amp-scaler-once"
    kind = Kind.CHANGES_TRAINING
    examples = (Example.from_files("AR203"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        for scaler in f.bindings_of(SCALER):
            loops = [a for a in f.ancestors(scaler.stmt) if isinstance(a, (cst.For, cst.While))
                     and f.function(a) is f.function(scaler.stmt)]
            if not loops:
                continue
            outer = loops[-1]
            if not m.matches(scaler.stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])])):
                ctx.skip(scaler.stmt, "a GradScaler built inside a loop, in a form this rule does not "
                                      "move: build it once, before the loop")
                continue
            set_in_loop = {n.value for n in m.findall(outer, m.AssignTarget(m.Name()) | m.For())
                           for n in m.findall(n.target, m.Name())}
            used = {n.value for n in m.findall(scaler.value, m.Name())}
            clash = sorted(used & set_in_loop - {scaler.path})
            if clash:
                ctx.skip(scaler.stmt, f"the GradScaler inside the loop uses `{clash[0]}`, which the loop "
                                      "sets: left where it is")
                continue
            ctx.edits.move_before(scaler.stmt, outer)
            ctx.change(scaler.stmt, f"`{short(scaler.stmt.body[0])}` moved out of the loop at line "
                                    f"{f.line(outer)}: one scaler per run keeps the scale it learnt")
