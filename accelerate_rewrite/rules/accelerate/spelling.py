"""``--backend accelerate``: the Fabric plan, spelled in Hugging Face Accelerate's API.

The Fabric rules decide and record their edits as for ``--backend fabric``, from the same
facts and plan (where set-up goes, which model and optimizer train, what runs on rank 0); the
engine hands each changed file's text here (``spell``), and its Fabric calls are written as
Accelerate's (accelerate 1.15, read in accelerate/accelerator.py):

=====================================  ==============================================
Fabric                                 Accelerate
=====================================  ==============================================
``Fabric(precision="bf16-mixed")``     ``Accelerator(mixed_precision="bf16")``
``fabric.launch()``                    (nothing: ``python train.py`` or ``accelerate launch``)
``fabric.launch(fn, *args)``           ``fn(accelerator, *args)``
``fabric.setup(model, optimizer)``     ``accelerator.prepare(model, optimizer)``
``fabric.setup_module / _optimizers``  ``accelerator.prepare``
``fabric.setup_dataloaders(a, b)``     ``accelerator.prepare(a, b)``
``fabric.backward(loss)``              ``accelerator.backward(loss)``
``fabric.clip_gradients(m, o, max_norm=x)``  ``accelerator.clip_grad_norm_(m.parameters(), x)``
``fabric.is_global_zero``, ``global_rank``, ``local_rank``, ``world_size``
                                       ``is_main_process``, ``process_index``,
                                       ``local_process_index``, ``num_processes``
``fabric.barrier()``                   ``accelerator.wait_for_everyone()``
``fabric.all_reduce(t, reduce_op=r)``  ``accelerator.reduce(t, reduction=r)``
``fabric.rank_zero_first()``           ``accelerator.main_process_first()``
``model.mark_forward_method(...)``     (nothing on one process; refused on several)
``model.state_dict()`` (several)       ``accelerator.unwrap_model(model).state_dict()``
=====================================  ==============================================

On several processes (one node: ``accelerate launch --multi_gpu --num_processes N`` or torchrun starts
them) the plan adds what Accelerate's wrapper needs: ``prepare`` returns the model wrapped in
DistributedDataParallel, whose ``state_dict()`` keys, named parameters and attributes are not
the module's (Fabric's wrapper keeps them), so every other read of the set-up model goes
through ``accelerator.unwrap_model(model)`` (rules/fabric/_wrapped.py; a method of the model's
own that runs it, or the model handed to code the analysis can't see, is refused); loaders
that stay whole (evaluation, or sharded by their own DistributedSampler, which ``prepare``
would shard again) are ``prepare_data_loader(loader, accelerator.device, num_processes=1,
process_index=0, put_on_device=True)``; a training loader is prepared right before its first
read, not where it is built (``prepare`` of a loader that shuffles draws a seed from torch's
generator there, which before the model is built would change its initial weights:
rules/fabric/_loaders.py); ``all_reduce`` of a Python number takes
``torch.as_tensor`` first; a removed ``destroy_process_group()`` becomes
``accelerator.end_training()``. Fabric's ``save`` / ``load`` of a state with modules in it has
no Accelerate equivalent: torch's save stays, written by the main process
(rules/fabric/checkpoint.py). On any number of processes, what the prepared optimizer does not
answer itself (a method of the optimizer's own class, SAM's ``first_step``) is read on
``optimizer.optimizer`` (rules/fabric/_wrapped.py). Anything else without an equivalent is
refused with its name.
"""

from __future__ import annotations

import ast
import re
from typing import Optional, Sequence, Union

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from accelerate_rewrite.codemod.analysis.facts import code
from accelerate_rewrite.options import ACCELERATE_PRECISIONS, Options

NAME = "accelerator"
#: Fabric's attributes -> Accelerate's (the same where absent from both maps)
_RENAMED = {
    "setup": "prepare", "setup_module": "prepare", "setup_optimizers": "prepare", "setup_dataloaders": "prepare",
    "is_global_zero": "is_main_process", "global_rank": "process_index", "local_rank": "local_process_index",
    "world_size": "num_processes", "barrier": "wait_for_everyone", "all_reduce": "reduce",
    "rank_zero_first": "main_process_first",
}
_SAME = {"backward", "print", "device", "unwrap_model", "end_training", "accumulate", "sync_gradients"}
#: keywords of Fabric's calls that one process makes no matter of (on several,
#: ``use_distributed_sampler=False`` is written as ``prepare_data_loader``: ``_Spell._whole``)
_IGNORED_KEYWORDS = {"setup_dataloaders": {"use_distributed_sampler"}}
_EQUAL = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


class _Untranslatable(Exception):
    pass


def _ref(name: str) -> m.BaseMatcherNode:
    """``name`` or ``self.name``: how the rules spell the Fabric object, and the spelling's."""
    return m.Name(name) | m.Attribute(value=m.Name("self"), attr=m.Name(name))


def _is_fabric(node: cst.CSTNode) -> bool:
    return m.matches(node, _ref("fabric"))


def _strategy_options(value: cst.BaseExpression) -> Optional[list[cst.Arg]]:
    """DistributedDataParallel's options that Fabric's ``strategy=`` carries, as keywords of
    Accelerate's ``DistributedDataParallelKwargs`` ([] for none), or None where there is no
    equivalent written."""
    if isinstance(value, cst.SimpleString) and value.evaluated_value in ("auto", "ddp"):
        return []
    if isinstance(value, cst.SimpleString) and value.evaluated_value == "ddp_find_unused_parameters_true":
        return [cst.Arg(cst.Name("True"), keyword=cst.Name("find_unused_parameters"), equal=_EQUAL)]
    if isinstance(value, cst.IfExp):  # the script's own world: "ddp_find_unused_parameters_true" if ... else "auto"
        sides = [_strategy_options(value.body), _strategy_options(value.orelse)]
        # DDP's options go unused where there is one process
        return None if None in sides else max(sides, key=len)
    if isinstance(value, cst.Call) and m.matches(value.func, m.Name("DDPStrategy")) \
            and all(a.keyword is not None for a in value.args):
        return [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in value.args]
    return None


def _accelerator_call(fabric: cst.Call, accumulate: Optional[int] = None) -> cst.Call:
    """``Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")`` ->
    ``Accelerator(cpu=True, mixed_precision="bf16")``. The devices go: ``accelerate launch
    --num_processes N`` (or torchrun) starts the processes, and ``Accelerator()`` reads them."""
    args: list[cst.Arg] = []
    for arg in fabric.args:
        key = arg.keyword.value if arg.keyword is not None else None
        value = arg.value
        literal = value.evaluated_value if isinstance(value, cst.SimpleString) else None
        if key in ("devices", "num_nodes"):  # the launcher's (accelerate launch, torchrun): Accelerator reads them
            continue
        if key == "strategy" and _strategy_options(value) is not None:
            options = _strategy_options(value)
            if options:
                comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                handler = cst.Call(func=cst.Name("DistributedDataParallelKwargs"),
                                   args=[a.with_changes(comma=comma if i < len(options) - 1 else cst.MaybeSentinel.DEFAULT)
                                         for i, a in enumerate(options)])
                args.append(cst.Arg(cst.List([cst.Element(handler)]), keyword=cst.Name("kwargs_handlers"),
                                    equal=_EQUAL))
            continue
        if key == "accelerator" and literal in ("auto", "cuda", "gpu"):
            continue
        if key == "accelerator" and literal == "cpu":
            args.append(cst.Arg(keyword=cst.Name("cpu"), value=cst.Name("True"), equal=_EQUAL))
            continue
        if key == "precision" and literal in ACCELERATE_PRECISIONS:
            if ACCELERATE_PRECISIONS[literal] != "no":
                args.append(cst.Arg(keyword=cst.Name("mixed_precision"), equal=_EQUAL,
                                    value=cst.SimpleString(f'"{ACCELERATE_PRECISIONS[literal]}"')))
            continue
        raise _Untranslatable(f"`{key}={code(value)}` of Fabric(...) has no "
                              "Accelerate equivalent written yet")
    if accumulate is not None:  # rules/techniques/accumulate.py: ``accelerator.accumulate(model)``
        args.append(cst.Arg(keyword=cst.Name("gradient_accumulation_steps"), value=cst.Integer(str(accumulate)),
                            equal=_EQUAL))
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return cst.Call(func=cst.Name("Accelerator"), args=[a.with_changes(comma=comma if i < len(args) - 1 else
                                                                       cst.MaybeSentinel.DEFAULT)
                                                        for i, a in enumerate(args)])


class _Spell(cst.CSTTransformer):
    def __init__(self, several: bool, accumulate: Optional[int] = None) -> None:
        self.problems: list[str] = []
        self.several = several  # several processes: evaluation loaders stay whole by other means
        self.accumulate = accumulate  # --accumulate N: Accelerator(gradient_accumulation_steps=N)
        self.accumulating = 0  # how deep in ``with fabric.accumulate(...)`` blocks
        self.needs_torch = False
        self.imports: list[tuple[str, str]] = []  # (module, name) the spelling reads

    def _fail(self, why: str) -> None:
        if why not in self.problems:
            self.problems.append(why)

    # -- imports --
    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom
                         ) -> Union[cst.ImportFrom, cst.RemovalSentinel]:
        module = code(original.module) if original.module is not None else ""
        if module in ("lightning.fabric", "lightning_fabric", "lightning.fabric.strategies",
                      "lightning_fabric.strategies"):
            names = [] if isinstance(updated.names, cst.ImportStar) else [a.name.value for a in updated.names
                                                                           if isinstance(a.name, cst.Name)]
            if names == ["Fabric"]:
                return updated.with_changes(module=cst.Name("accelerate"),
                                            names=[cst.ImportAlias(name=cst.Name("Accelerator"))])
            if names == ["DDPStrategy"]:
                return updated.with_changes(module=cst.Attribute(cst.Name("accelerate"), cst.Name("utils")),
                                            names=[cst.ImportAlias(name=cst.Name("DistributedDataParallelKwargs"))])
            self._fail(f"`from {module} import ...` has no Accelerate equivalent written yet")
            return original
        return updated

    # -- names --
    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=NAME) if updated.value == "fabric" else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if m.matches(updated, m.Attribute(value=m.Name("self"), attr=m.Name(NAME))):
            return updated
        if _is_fabric(original.value) or m.matches(updated.value, _ref(NAME)):
            attr = updated.attr.value
            if attr in _RENAMED:
                return updated.with_changes(attr=cst.Name(_RENAMED[attr]))
            if attr not in _SAME and attr not in ("launch", "clip_gradients"):
                self._fail(f"`fabric.{attr}` has no Accelerate equivalent written yet")
        return updated

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        if updated.keyword is not None and updated.keyword.value == "fabric":
            return updated.with_changes(keyword=cst.Name(NAME))
        return updated

    # -- accumulation --
    def visit_With(self, node: cst.With) -> None:
        if any(m.matches(i.item, m.Call(func=m.Attribute(value=_ref("fabric"), attr=m.Name("accumulate"))))
               for i in node.items):
            self.accumulating += 1

    def leave_With(self, original: cst.With, updated: cst.With) -> cst.With:
        if any(m.matches(i.item, m.Call(func=m.Attribute(value=_ref("fabric"), attr=m.Name("accumulate"))))
               for i in original.items):
            self.accumulating -= 1
        return updated

    # -- calls --
    def visit_Call(self, node: cst.Call) -> None:
        if self.accumulate is not None and not self.accumulating and m.matches(
                node.func, m.Attribute(value=_ref("fabric"), attr=m.Name("backward"))):
            # every accelerator.backward is divided by gradient_accumulation_steps
            spelled = re.sub(r"\bfabric\b", NAME, code(node))
            self._fail(f"`{spelled}` does not run under `accelerator.accumulate(...)` (rule AR302 says "
                       "why), and Accelerate divides every backward by gradient_accumulation_steps, which "
                       "another loop needs; use --backend fabric to accumulate where it can")

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if m.matches(original.func, m.Name("Fabric")):
            try:
                return _accelerator_call(original, self.accumulate)
            except _Untranslatable as exc:
                self._fail(str(exc))
                return updated
        if m.matches(original.func, m.Name("DDPStrategy")):
            return updated  # its options become DistributedDataParallelKwargs (_accelerator_call)
        func = original.func
        if m.matches(func, m.Attribute(value=m.Name("torch"), attr=m.Name("load"))):
            return self._load(updated)
        if not (isinstance(func, cst.Attribute) and _is_fabric(func.value)):
            return updated
        attr = func.attr.value
        new_func = updated.func
        assert isinstance(new_func, cst.Attribute)
        if attr == "setup_dataloaders" and self.several and any(
                a.keyword is not None and a.keyword.value == "use_distributed_sampler"
                and m.matches(a.value, m.Name("False")) for a in updated.args):
            return self._whole(updated, new_func.value)
        if attr in _IGNORED_KEYWORDS:
            updated = updated.with_changes(args=_without(updated.args, _IGNORED_KEYWORDS[attr]))
        if attr in ("setup", "setup_module", "setup_optimizers", "setup_dataloaders", "backward", "print",
                    "barrier", "rank_zero_first"):
            # ``backward``'s keywords go to ``loss.backward`` in both (``retain_graph=True``), but
            # Fabric's ``model=`` (DeepSpeed's engine)
            if attr != "print" and any(a.keyword is not None and (attr != "backward" or a.keyword.value == "model")
                                       for a in updated.args):
                self._fail(f"`fabric.{attr}(..., {_keywords(updated)})` has no Accelerate equivalent written yet")
            return updated
        if attr == "all_reduce":
            args = [a.with_changes(keyword=cst.Name("reduction")) if a.keyword is not None
                    and a.keyword.value == "reduce_op" else a for a in updated.args]
            if args and args[0].keyword is None:  # Fabric takes Python numbers too, Accelerate tensors only
                args[0] = args[0].with_changes(value=cst.parse_expression(
                    f"torch.as_tensor({code(args[0].value)}, device={code(new_func.value)}.device)"))
                self.needs_torch = True
            if any(a.keyword is not None and a.keyword.value not in ("reduction",) for a in args):
                self._fail(f"`fabric.all_reduce(..., {_keywords(updated)})` has no Accelerate equivalent written yet")
            return updated.with_changes(args=args)
        if attr == "clip_gradients":
            return self._clip(updated, new_func)
        if attr == "launch":
            if not updated.args:
                return updated  # the statement goes (leave_SimpleStatementLine)
            target, rest = updated.args[0], list(updated.args[1:])
            return cst.Call(func=target.value, args=[cst.Arg(value=new_func.value, comma=cst.Comma(
                whitespace_after=cst.SimpleWhitespace(" ")) if rest else cst.MaybeSentinel.DEFAULT), *rest])
        return updated  # what has no equivalent is said by leave_Attribute

    @staticmethod
    def _load(call: cst.Call) -> cst.Call:
        """``torch.load(path, map_location=accelerator.device)``: Accelerate's device on several
        CPU processes is ``cpu:0``, which torch.load can't map to (measured, accelerate 1.15,
        torch 2.13): ``"cpu"`` there, the device elsewhere."""
        args = []
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "map_location" and m.matches(
                    arg.value, m.Attribute(value=_ref(NAME), attr=m.Name("device"))):
                device = code(arg.value)
                arg = arg.with_changes(value=cst.parse_expression(f'"cpu" if {device}.type == "cpu" else {device}'))
            args.append(arg)
        return call.with_changes(args=args)

    def _whole(self, call: cst.Call, ref: cst.BaseExpression) -> cst.BaseExpression:
        """``fabric.setup_dataloaders(a, b, use_distributed_sampler=False)`` on several processes:
        each loader whole, its batches moved to the device, as Fabric's:
        ``prepare_data_loader(a, accelerator.device, num_processes=1, process_index=0,
        put_on_device=True)`` (accelerate.data_loader; ``prepare`` would shard it)."""
        loaders = [a.value for a in call.args if a.keyword is None]
        if len(loaders) != len(call.args) - 1:
            self._fail(f"`fabric.setup_dataloaders(..., {_keywords(call)})` has no Accelerate equivalent written yet")
            return call
        self.imports.append(("accelerate.data_loader", "prepare_data_loader"))
        made = [cst.parse_expression(f"prepare_data_loader({code(x)}, {code(ref)}.device, num_processes=1, "
                                     "process_index=0, put_on_device=True)") for x in loaders]
        if len(made) == 1:
            return made[0]
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return cst.Tuple([cst.Element(x, comma=comma if i < len(made) - 1 else cst.MaybeSentinel.DEFAULT)
                          for i, x in enumerate(made)])

    def _clip(self, call: cst.Call, func: cst.Attribute) -> cst.Call:
        """``fabric.clip_gradients(model, optimizer, max_norm=x)`` ->
        ``accelerator.clip_grad_norm_(model.parameters(), x)`` (``clip_val=``: ``clip_grad_value_``)."""
        positional = [a for a in call.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        module = positional[0].value if positional else keywords.get("module")
        if "error_if_nonfinite" in keywords and m.matches(keywords["error_if_nonfinite"], m.Name("False")):
            del keywords["error_if_nonfinite"]  # torch's clip_grad_norm_'s own default, which Accelerate's calls
        if module is None or set(keywords) - {"module", "optimizer", "max_norm", "clip_val", "norm_type"} \
                or len(positional) > 2 or ("max_norm" in keywords) == ("clip_val" in keywords):
            self._fail(f"`fabric.clip_gradients(...)` with {_keywords(call) or 'these arguments'} has no "
                       "Accelerate equivalent written yet")
            return call
        params = cst.Call(func=cst.Attribute(value=module, attr=cst.Name("parameters")))
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        if "max_norm" in keywords:
            args = [cst.Arg(params, comma=comma), cst.Arg(keywords["max_norm"])]
            if "norm_type" in keywords:
                args = [args[0], args[1].with_changes(comma=comma),
                        cst.Arg(keywords["norm_type"], keyword=cst.Name("norm_type"), equal=_EQUAL)]
            return call.with_changes(func=func.with_changes(attr=cst.Name("clip_grad_norm_")), args=args)
        return call.with_changes(func=func.with_changes(attr=cst.Name("clip_grad_value_")),
                                 args=[cst.Arg(params, comma=comma), cst.Arg(keywords["clip_val"])])

    # -- statements that go --
    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
                                  ) -> Union[cst.SimpleStatementLine, cst.RemovalSentinel]:
        if len(original.body) == 1 and isinstance(original.body[0], cst.Expr):
            call = original.body[0].value
            if isinstance(call, cst.Call) and not call.args and m.matches(
                    call.func, m.Attribute(attr=m.Name("launch"))) and _is_fabric(call.func.value):
                return cst.RemoveFromParent()  # one process: nothing to launch
            if isinstance(call, cst.Call) and m.matches(call.func, m.Attribute(attr=m.Name("mark_forward_method"))):
                return cst.RemoveFromParent()  # one process: the prepared model is the module itself
        return updated


def _without(args, keywords: set[str]) -> list[cst.Arg]:
    kept = [a for a in args if a.keyword is None or a.keyword.value not in keywords]
    if kept and len(kept) != len(args):
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return kept


def _keywords(call: cst.Call) -> str:
    return ", ".join(f"{a.keyword.value}=" for a in call.args if a.keyword is not None)


def own_name(source: str) -> bool:
    """The script binds or reads a name ``accelerator`` of its own (the spelling would take it)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True
    return any(isinstance(n, ast.Name) and n.id == NAME or isinstance(n, ast.arg) and n.arg == NAME
               or isinstance(n, ast.alias) and (n.asname or n.name) == NAME for n in ast.walk(tree))


#: rules/techniques/accumulate.py's ``with fabric.accumulate(model):`` (Fabric has no such method)
_ACCUMULATES = re.compile(r"\bfabric\.accumulate\(")


def spell(options: Options, source: str, code: str, program: Sequence[str] = ()) -> tuple[str, Optional[str]]:
    """The text ``code`` (a file the Fabric rules changed; ``source`` its original) in
    Accelerate's API, or why it can't be (then the engine leaves the rule that needs it out).
    ``program``: every file of the program (``code`` among them) as the rules left it: where
    one accumulates (``--accumulate``), ``Accelerator(gradient_accumulation_steps=N)``."""
    if own_name(source):
        return code, "the script has a name `accelerator` of its own, which Accelerate's object would take"
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as exc:  # the engine's checks say what is wrong with it
        return code, f"the result does not parse ({exc})"
    accumulates = any(_ACCUMULATES.search(text) for text in (*program, code))
    speller = _Spell(options.many_devices, options.accumulate if accumulates else None)
    new = module.visit(speller)
    if speller.problems:
        return code, "; ".join(speller.problems)
    imports = list(speller.imports)
    if "DistributedDataParallelKwargs(" in new.code:
        imports.append(("accelerate.utils", "DistributedDataParallelKwargs"))
    if speller.needs_torch and not any(isinstance(n, ast.Import) and any(a.name == "torch" and a.asname is None
                                                                        for a in n.names)
                                       for n in ast.walk(ast.parse(new.code))):
        return code, "`fabric.all_reduce` becomes `accelerator.reduce(torch.as_tensor(...))`, and the file " \
                     "does not import torch"
    if imports:
        context = CodemodContext()
        for module_name, name in imports:
            AddImportsVisitor.add_needed_import(context, module_name, name)
        new = AddImportsVisitor(context).transform_module(new)
    return new.code, None


#: what the notes say of Fabric's API, as Accelerate's
_SAID = [
    (re.compile(r"`fabric = Fabric\([^`]*\)`(?: and launched it)?"), None),
    (re.compile(r'Fabric\(accelerator="cpu"\)'), "Accelerator(cpu=True)"),
    # ``fabric.launch(fn, *args)`` is spelled ``fn(accelerator, *args)`` (and the notes say so)
    (re.compile(r"`fabric\.launch\((\w+), ([^`]*)\)`"), r"`\1(fabric, \2)`"),
    (re.compile(r"`fabric\.launch\((\w+)\)`"), r"`\1(fabric)`"),
    (re.compile(r"\bFabric starts (?:and ends )?the processes\b"),
     "the launcher (`accelerate launch`, torchrun) starts the processes"),
    (re.compile(r"the processes are Fabric's \(devices\)"), "the processes are the launcher's"),
    (re.compile(r"LT_ACCELERATOR=cpu"), "ACCELERATE_USE_CPU=1"),
    (re.compile(r"fabric\.setup_dataloaders\b"), "accelerator.prepare"),
    (re.compile(r"fabric\.setup_module\b"), "accelerator.prepare"),
    (re.compile(r"fabric\.setup_optimizers\b"), "accelerator.prepare"),
    (re.compile(r"fabric\.setup\b"), "accelerator.prepare"),
    (re.compile(r"fabric\.clip_gradients\b"), "accelerator.clip_grad_norm_"),
    (re.compile(r"fabric\.barrier\b"), "accelerator.wait_for_everyone"),
    (re.compile(r"fabric\.is_global_zero\b"), "accelerator.is_main_process"),
    (re.compile(r"fabric\.global_rank\b"), "accelerator.process_index"),
    (re.compile(r"fabric\.local_rank\b"), "accelerator.local_process_index"),
    (re.compile(r"fabric\.world_size\b"), "accelerator.num_processes"),
    (re.compile(r"fabric\.all_reduce\b"), "accelerator.reduce"),
    (re.compile(r"fabric\.rank_zero_first\b"), "accelerator.main_process_first"),
    (re.compile(r"(?<!--backend )\bfabric\b"), NAME),
    (re.compile(r"(?<!Lightning )\bFabric's\b"), "Accelerate's"),
    (re.compile(r"(?<!Lightning )\bFabric\b"), "Accelerate"),
]


def said(message: str, created: Optional[str]) -> str:
    """A note's ``message`` about the Fabric rules' edit, said of Accelerate's spelling;
    ``created``: the ``accelerator = Accelerator(...)`` line the file got."""
    if created is None:
        message = _SAID[0][0].sub("`accelerator = Accelerator(...)`", message)
    for pattern, new in _SAID:
        message = pattern.sub(f"`{created}`" if new is None and created else (new or "`accelerator`"), message)
    return message


def created_line(code: str) -> Optional[str]:
    """The ``accelerator = Accelerator(...)`` statement of a spelled file."""
    match = re.search(rf"^\s*({NAME} = Accelerator\(.*\))\s*$", code, re.M)
    return match.group(1) if match else None


class AccelerateSpelling:
    """The engine's ``Spelling`` (codemod/engine.py) for ``--backend accelerate``."""

    def spell(self, options: Options, source: str, code: str, program: Sequence[str] = ()
              ) -> tuple[str, Optional[str]]:
        return spell(options, source, code, program)

    def said(self, message: str, code: str) -> str:
        return said(message, created_line(code))


SPELLING = AccelerateSpelling()
