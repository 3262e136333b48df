from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DATA_PARALLEL, HAND_DDP, Binding, ScriptFacts, code
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options, freeze_form
from accelerate_rewrite.rules.base.plan import expr, short, stmt

HELPER = "freeze_parameters"
FORMS = {  # the helper's branch for each form of pattern, as the options module tells them apart
    "slice": """\
        if bracket and ":" in rest and rest.endswith("]"):  # a slice of a ModuleList
            start, stop = (int(x) if x else None for x in rest[:-1].split(":"))
            try:
                indices = range(len(model.get_submodule(path)))[start:stop]
            except (AttributeError, TypeError):
                indices = range(0)
            prefixes = tuple(f"{path}.{i}." for i in indices)
            hits = [n for n in names if prefixes and n.startswith(prefixes)]
""",
    "glob": """\
        if any(c in pattern for c in "*?["):  # a glob over parameter names
            hits = fnmatch.filter(names, pattern)
""",
    "path": """\
        if True:  # a module path: the module and everything in it
            hits = [n for n in names if n == pattern or n.startswith(pattern + ".")]
""",
}


def helper_code(forms: set[str]) -> str:
    """``freeze_parameters``, with the branches for the forms of pattern in use only."""
    branches = [FORMS[f] for f in ("slice", "glob", "path") if f in forms]
    for k in range(1, len(branches)):
        branches[k] = branches[k].replace("        if ", "        elif ", 1)
    if len(branches) > 1:  # the last form is what is left
        first, rest = branches[-1].split("\n", 1)
        branches[-1] = "        else:  #" + first.split("#", 1)[1] + "\n" + rest
    body = "".join(branches)
    if len(branches) == 1:  # no choice to make: the branch's body only
        lines = body.splitlines(keepends=True)
        body = "".join(line[4:] for line in lines[1:])
    split = '        path, bracket, rest = pattern.partition("[")\n' if "slice" in forms else ""
    return f'''

def {HELPER}(model, patterns):
    """Stop training the parameters the patterns name (added by accelerate-rewrite, --freeze).

    A pattern that names no parameter is an error: the model is not what it expects.
    """
    names = [name for name, _ in model.named_parameters()]
    frozen = set()
    for pattern in patterns:
{split}{body}        if not hits:
            modules = ", ".join([n for n, _ in model.named_modules() if n][:8])
            raise ValueError(f"--freeze {{pattern!r}} matches no parameter of {{type(model).__name__}}; "
                             f"its modules include: {{modules}}")
        frozen.update(hits)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
'''


REQUIRES_GRAD = "p.requires_grad"


class Freeze(Rule):
    """`--freeze PATTERN` (repeatable): don't train the parameters the patterns name.

    What it does: right after the model is built, before it is set up with Fabric or wrapped
    (freezing after DDP wraps it breaks the gradient reduction), it adds
    `freeze_parameters(model, ["embeddings", "encoder.layer[:2]"])`, a small function put into
    the script once, that sets `requires_grad=False` on every parameter a pattern names:
    - a module path: `embeddings`, `encoder.layer.0` (the module and everything in it);
    - a slice of a ModuleList or Sequential: `encoder.layer[:2]`, `encoder.layer[-2:]`;
    - a glob over parameter names: `encoder.layer.[01].*`, `*.bias`.
    A pattern that names no parameter fails when the script runs, naming the pattern and some
    of the modules the model has (the rewrite can't see the model's structure).
    Each optimizer of that model then gets only the trainable parameters:
    `[p for p in model.parameters() if p.requires_grad]`; parameter groups are filtered group
    by group, keeping their options, and a comprehension over `named_parameters()` gets
    `and p.requires_grad` added to its condition.
    With several models, a pattern starts with the model's name: `--freeze netD.main.0`.

    Why: fine-tuning only the top of a pretrained model saves the gradients and optimizer
    state of the rest, and often generalises better on small data.

    Kind: changes-training (the frozen parameters keep their values; the rest trains as
    before, so the losses differ). BatchNorm layers that are frozen still update their running
    statistics in train mode.

    Leaves alone (and says why): a model wrapped in DDP/DataParallel in the statement that
    builds it, a model whose construction can't be found, optimizers whose parameters come from
    a name the rewrite can't follow (the frozen parameters get no gradient, so they don't move
    either way), a script that already defines `freeze_parameters`, and scripts that use
    Fabric, the Trainer or Accelerate.
    """

    code = "AR303"
    name = "freeze"
    kind = Kind.CHANGES_TRAINING
    examples = (Example.from_files("AR303", options={"freeze": ("embeddings", "encoder.layer[:2]")}),)

    def applies(self, options: Options) -> bool:
        return bool(options.freeze)

    def rewrite(self, ctx: RuleContext) -> None:
        f, patterns = ctx.facts, ctx.options.freeze
        if f.frameworks:
            label, node = f.frameworks[0]
            ctx.skip(node, f"--freeze: the script already uses {label}; freeze the layers with its API")
            return
        if f.functions.get(HELPER) is not None:
            ctx.skip(f.functions[HELPER].node, f"the script already defines `{HELPER}`: nothing frozen")
            return
        models = _models(f)
        if not models:
            ctx.skip(None, "--freeze: no model trained by an optimizer found")
            return
        names = {b.path.removeprefix("self."): b for b in models}
        targets: dict[int, tuple[Binding, list[str]]] = {}
        for pattern in patterns:
            if len(models) == 1:
                binding, rest = models[0], pattern
            else:
                head, _, rest = pattern.partition(".")
                binding = names.get(head)
                if binding is None or not rest:
                    ctx.skip(models[0].stmt, f"--freeze {pattern}: the script trains {len(models)} models "
                                   f"({', '.join(names)}): start the pattern with one of their names")
                    continue
            targets.setdefault(id(binding), (binding, []))[1].append(rest)
        inserted = False
        for binding, chosen in targets.values():
            if any(f.qualnames(c.func) & {*HAND_DDP, *DATA_PARALLEL} for c in m.findall(binding.value, m.Call())):
                ctx.skip(binding.stmt, f"`{short(binding.value)}` wraps the model as it builds it: build "
                                       "it first, then wrap it, so that it can be frozen in between")
                continue
            listed = ", ".join(f'"{p}"' for p in chosen)
            ctx.edits.insert_after(binding.stmt, stmt(f"{HELPER}({binding.path}, [{listed}])\n"))
            ctx.change(binding.stmt, f"`{binding.path}`: {listed.replace(chr(34), '')} frozen before it "
                                     "is set up or wrapped")
            inserted = True
            self._filter_optimizers(ctx, binding)
        if inserted:
            forms = {freeze_form(p) for p in patterns}
            add_helper(ctx, cst.parse_module(helper_code(forms)).body[0])
            if "glob" in forms:
                ctx.edits.add_import("fnmatch")

    def _filter_optimizers(self, ctx: RuleContext, binding: Binding) -> None:
        f = ctx.facts
        for opt in f.optimizers:
            if not any(f.same_object(k, binding.key) for k in opt.models) or opt.call is None:
                continue
            arg = next((a for a in opt.call.args if a.keyword and a.keyword.value == "params"), None)
            if arg is None and opt.call.args and opt.call.args[0].keyword is None and not opt.call.args[0].star:
                arg = opt.call.args[0]
            if arg is None:
                continue
            value = arg.value
            if "requires_grad" in code(value):
                ctx.skip(opt.call, f"`{short(opt.call)}` already takes the trainable parameters only")
                continue
            groups = f.assigned_value(value) if isinstance(value, cst.Name) else value
            if isinstance(groups, (cst.List, cst.Tuple)) and groups.elements and all(
                    isinstance(e.value, cst.Dict) for e in groups.elements):
                done = 0
                for element in groups.elements:
                    entry = next((e for e in element.value.elements if isinstance(e, cst.DictElement)
                                  and m.matches(e.key, m.SimpleString()) and e.key.evaluated_value == "params"),
                                 None)
                    if entry is not None:
                        ctx.edits.replace(entry.value, _trainable)
                        done += 1
                if done:
                    ctx.change(opt.call, f"`{short(opt.call)}`: each of its parameter groups takes the "
                                         "trainable parameters only")
                continue
            if isinstance(value, (cst.Name, cst.Attribute)):
                ctx.skip(opt.call, f"`{short(opt.call)}` takes `{code(value)}`: its frozen parameters stay in "
                                   "it (they get no gradient, so they don't move)")
                continue
            ctx.edits.replace(value, _trainable)
            ctx.change(opt.call, f"`{short(opt.call)}` takes the trainable parameters only")


def last_top_import(body: list) -> Optional[cst.BaseStatement]:
    """The last import of the block of imports at the top of a module (after its docstring)."""
    last_import = None
    for s in body:
        if m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])):
            last_import = s
        elif not m.matches(s, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) or last_import:
            break
    return last_import


def add_helper(ctx: RuleContext, helper: cst.BaseStatement) -> None:
    """Put a function the rewrite needs into the script: after the imports at its top, with
    two blank lines around it."""
    body = list(ctx.facts.module.body)
    last_import = last_top_import(body)
    helper = helper.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    if last_import is not None:
        ctx.edits.insert_after(last_import, helper)
        following = body[body.index(last_import) + 1] if body.index(last_import) + 1 < len(body) else None
        blanks = 0
        for line in getattr(following, "leading_lines", ()):
            if line.comment is not None:
                break
            blanks += 1
        if following is not None and blanks < 2:  # two blank lines after a def or class, as before one
            ctx.edits.replace(following, lambda updated, n=2 - blanks: updated.with_changes(
                leading_lines=[cst.EmptyLine()] * n + list(updated.leading_lines)))
    else:
        ctx.edits.insert_before(body[0], helper.with_changes(leading_lines=[]))


def _models(f: ScriptFacts) -> list[Binding]:
    """Where each model an optimizer trains is built (first built), in the order of the script:
    a module built in the script, or the value a factory returns (``model = build_model()``)."""
    keys: list = []
    for opt in f.optimizers:
        for key in opt.models:
            if not any(f.same_object(key, seen) for seen in keys):
                keys.append(key)
    out: list[Binding] = []
    for key in keys:
        built = [b for b in f.bindings if f.same_object(b.key, key)]
        built += [b for k in f.kinds if f.same_object(k, key) for b in _assignments(f, k)]
        built.sort(key=lambda b: f.line(b.stmt))
        if built:
            out.append(built[0])
    return sorted(out, key=lambda b: f.line(b.stmt))


def _assignments(f: ScriptFacts, key) -> list[Binding]:
    """``name = <value>`` statements that bind the key (a plain name)."""
    owner, path = key
    scope = f.scope_of_owner(owner)
    if scope is None or path.startswith("self."):
        return []
    out = []
    for assignment in f.in_order(scope.assignments[path], lambda a: getattr(a, "node", None)):
        node = getattr(assignment, "node", None)
        target = f.parent(node) if isinstance(node, cst.CSTNode) else None
        assign = f.parent(target) if isinstance(target, cst.AssignTarget) else None
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and target.target is node:
            value = assign.value
            out.append(Binding(key, "module", f.statement(assign), value,
                               value if isinstance(value, cst.Call) else None, ""))
    return out


def _trainable(value: cst.BaseExpression) -> cst.BaseExpression:
    """``[p for p in <value> if p.requires_grad]``, or ``and p.requires_grad`` added to the
    condition of a comprehension that yields ``p``."""
    if isinstance(value, (cst.ListComp, cst.GeneratorExp)) and isinstance(value.elt, cst.Name) \
            and value.for_in.inner_for_in is None and len(value.for_in.ifs) <= 1:
        check = expr(f"{value.elt.value}.requires_grad")
        ifs = value.for_in.ifs
        if ifs:
            test = ifs[0].test
            if isinstance(test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not test.lpar:
                test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            new_if = ifs[0].with_changes(test=cst.BooleanOperation(test, cst.And(), check))
        else:
            new_if = cst.CompIf(test=check)
        return value.with_changes(for_in=value.for_in.with_changes(ifs=[new_if]))
    return expr(f"[p for p in {code(value.with_changes(lpar=[], rpar=[]))} if {REQUIRES_GRAD}]")
