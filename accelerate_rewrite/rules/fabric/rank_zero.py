from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import LOADER, MODEL, ScriptFacts
from accelerate_rewrite.codemod.analysis.libraries import prepares
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.plan import FABRIC_CORE, FabricRule, code, expr, names_rank, rank_guard, short, stmt
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.fabric.checkpoint import RANK_ZERO, TORCH_SAVE, classify_save, file_path

#: calls that write files or folders: on several processes each would write (the same file)
WRITERS = (
    "torchvision.utils.save_image", "matplotlib.pyplot.savefig", "os.mkdir", "os.makedirs",
    "shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.rmtree", "shutil.move",
    "numpy.save", "numpy.savez", "numpy.savetxt", "json.dump", "pickle.dump", "yaml.dump",
    "sys.stdout.write", "sys.stderr.write",  # a progress bar of the script's own
)
#: methods that write, whatever their receiver: a figure, a path, a TensorBoard writer, a model
WRITER_METHODS = (
    "savefig", "mkdir", "write_text", "write_bytes", "to_csv", "save_pretrained",
    "add_scalar", "add_scalars", "add_image", "add_images", "add_histogram", "add_figure",
    "add_text", "add_graph",
)
_WRITE_MODES = ("w", "a", "x", "+")
_COLLECTIVE_CALLS = ("torch.load", "torch.serialization.load", "torch.distributed")
_LOADS = ("torch.load", "torch.serialization.load")


def _makes_folder_safely(f: ScriptFacts, call: cst.Call) -> bool:
    """``os.makedirs(path, exist_ok=True)`` / ``path.mkdir(..., exist_ok=True)``: every process
    may run it, and must when it writes into the folder itself (a log file per rank): under a
    rank check the others could write there before it exists."""
    is_mkdir = f.qualnames(call) & {"os.makedirs"} or (
        isinstance(call.func, cst.Attribute) and call.func.attr.value == "mkdir")
    return bool(is_mkdir) and any(a.keyword is not None and a.keyword.value == "exist_ok"
                                  and m.matches(a.value, m.Name("True")) for a in call.args)


def _is_writer(f: ScriptFacts, call: cst.Call, options) -> bool:
    names = f.qualnames(call)
    if _makes_folder_safely(f, call):
        return False
    if names & set(WRITERS):
        return True
    if names & set(TORCH_SAVE):
        return classify_save(f, plan(f, options), call, options)[0] == RANK_ZERO
    if names & {"builtins.open", "io.open"}:
        mode = call.args[1].value if len(call.args) > 1 and call.args[1].keyword is None else next(
            (a.value for a in call.args if a.keyword is not None and a.keyword.value == "mode"), None)
        return isinstance(mode, cst.SimpleString) and any(c in str(mode.evaluated_value) for c in _WRITE_MODES)
    return isinstance(call.func, cst.Attribute) and call.func.attr.value in WRITER_METHODS and not names & {
        "builtins.print"}


def _downloads(call: cst.Call) -> bool:
    return any(a.keyword is not None and a.keyword.value == "download" and m.matches(a.value, m.Name("True"))
               for a in call.args)


class FabricRankZero(FabricRule):
    """Write files once: side effects on rank 0, downloads on rank 0 first, whole models saved
    unwrapped.

    What it does: in the code that runs after Fabric is created,
    - a statement that writes a file or folder (`torch.save` of something other than a state
      dict, `save_image`, `plt.savefig`, `open(..., "w")`, `os.makedirs` (but not
      `os.makedirs(..., exist_ok=True)`, which every process may run, and must where it then
      writes a file of its own there), `json.dump`,
      TensorBoard's `writer.add_scalar`, ...) or to the terminal (`sys.stdout.write`, a
      progress bar's) goes under `if fabric.is_global_zero:`
      (consecutive ones under one `if`); so does the call of a function of the script that
      writes where `fabric` can't be reached (`save_checkpoint(state, is_best)`);
    - `torch.save(model, path)` of a set-up model saves `model.module`, the script's own
      module, not Fabric's wrapper (which the script's loading code could not read back);
    - a statement that builds a dataset with `download=True` goes under
      `with fabric.rank_zero_first():`, so rank 0 downloads while the others wait, then read it;
    - data the script prepares on disk itself (`urllib.request.urlretrieve`, an archive's
      `extractall`, torchvision's `download_url`, ...; in the script, or in a function it calls,
      of any module of the project) runs on rank 0 alone, then `fabric.barrier()`: a second
      fetch or unpacking would rewrite the files another process is reading. Fabric is created
      before it for that;
    - a project helper that writes to the terminal itself (a progress bar's `sys.stdout.write`)
      is called on rank 0 only; the functions that call it receive `fabric` for that. A helper
      that also runs the model or draws a loader is not (the others would miss its
      collectives): its write is listed as per-process;
    - a file rank 0 alone writes with `torch.save` that every process then reads back
      (`torch.load` of the best model after training) gets `fabric.barrier()` before the read,
      so that no process reads it half-written; a whole model saved after Fabric redirected one
      of its methods (`mark_forward_method`) first loses the bound `forward` that the
      redirection left on it, which would not load back with `weights_only`.

    Why: with several devices every process runs the script: without it, each process writes
    the same files at once (and a checkpoint saved from each rank overwrites the others').

    Kind: safe (one device does the same).

    Leaves alone (and says why, with several devices): statements that also bind a name the
    rest of the script reads (`writer = SummaryWriter()`), statements already under a rank
    check, and writes where `fabric` can't be reached or that run before Fabric exists.
    """

    code = "AR110"
    name = "fabric-rank-zero"
    kind = Kind.SAFE
    requires = FABRIC_CORE
    examples = (Example.from_files("AR110", options={"devices": 2}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        p = plan(f, o)
        if p.refusal is not None:
            return
        guarded: dict[int, tuple[cst.BaseStatement, str, str]] = {}  # id(stmt) -> (stmt, ref, what)
        saved: list[cst.Call] = []  # the torch.save calls written on rank 0 only
        calls = {id(c): c for c in [*(s.call for s in f.calls), *f.attribute_calls]}
        writes = [c for c in calls.values() if _downloads(c) or prepares(f, c) or _is_writer(f, c, o)]
        preparing: set[int] = set()  # the functions that prepare data (their calls: rank 0, then a barrier)
        # a function of the script that writes, where `fabric` can't be reached: its callers
        # that can reach it guard the call (``save_checkpoint(state, is_best)``)
        writers: dict[int, list[cst.Call]] = {}
        for call in writes:
            func = f.function(call)
            fn = f.functions.get(func.name.value) if func is not None else None
            if fn is not None and fn.node is func and p.ref_at(f, call) is None and fn.calls \
                    and not fn.other_uses and not _downloads(call) and _light(f, func) and all(
                        p.ref_at(f, c) is not None and p.after_creation(f, c) for c in fn.calls):
                writers.setdefault(id(func), fn.calls)
                if prepares(f, call):
                    preparing.update(id(c) for c in fn.calls)
        covered = {id(c) for c in writes if f.function(c) is not None and id(f.function(c)) in writers}
        for call in sorted([c for c in writes if id(c) not in covered]
                           + [c for cs in writers.values() for c in cs], key=f.line):
            download = _downloads(call)
            what = "download" if download else "prepare" if prepares(f, call) or id(call) in preparing \
                else "write"
            ref = p.ref_at(f, call)
            if ref is None or not p.after_creation(f, call):
                if o.many_devices:
                    ctx.skip(call, f"`{short(call)}` runs on every process: `fabric` can't be reached "
                                   "here (guard it with a rank check by hand)")
                continue
            if rank_guard(f, call) is not None or names_rank(f, p, call) is not None:
                continue  # already guarded, or a file of each process's own (``log_rank{rank}.txt``)
            target = self._statement(f, call, o)
            if target is None:
                if o.many_devices:
                    ctx.skip(call, f"`{short(call)}` runs on every process: its statement binds a name "
                                   "that later code reads, so it can't go under a rank check"
                                   + (" (each process fetches or unpacks the data at once: run it once by "
                                      "hand, then a barrier)" if what == "prepare" else ""))
                continue
            if f.qualnames(call) & set(TORCH_SAVE):
                self._unwrap_model(ctx, p, call)
                saved.append(call)
            previous = guarded.get(id(target))
            if previous is None or previous[2] == "write" or what == "download":
                guarded[id(target)] = (target, ref, what)
        self._apply(ctx, [v for v in guarded.values() if not self._inside_other(f, v[0], guarded)])
        self._barriers(ctx, p, saved)

    def _barriers(self, ctx: RuleContext, p, saved: list[cst.Call]) -> None:
        """A file rank 0 alone writes that every process then reads back (``torch.load`` of the
        best model after training): ``fabric.barrier()`` before the read, so that no process
        reads it before rank 0 has finished writing it."""
        f = ctx.facts
        written = {}
        for call in saved:
            path = file_path(f, call.args[1].value) if len(call.args) > 1 else None
            if path is not None:
                written.setdefault(path, call)
        if not written:
            return
        done: set[int] = set()
        for call in f.calls_named(*_LOADS):
            path = file_path(f, call.args[0].value) if call.args else None
            save = written.get(path)
            if save is None or (f.function(call) is f.function(save) and f.line(call) <= f.line(save)):
                continue
            ref = p.ref_at(f, call)
            if ref is None or not p.after_creation(f, call) or rank_guard(f, call) is not None \
                    or self._called_under_rank_check(f, call):
                continue
            target = self._read_statement(f, call)
            if id(target) in done:
                continue
            done.add(id(target))
            # after the comment on top of the read, right before it
            ctx.edits.insert_before(target, stmt(f"{ref}.barrier()\n").with_changes(
                leading_lines=target.leading_lines))
            ctx.edits.replace(target, lambda u: u.with_changes(leading_lines=[]))
            ctx.change(call, f"`{ref}.barrier()` before reading `{path}`: rank 0 alone writes it (line "
                             f"{f.line(save)}), and every process reads it back")

    @staticmethod
    def _called_under_rank_check(f: ScriptFacts, node: cst.CSTNode) -> bool:
        func = f.function(node)
        fn = f.functions.get(func.name.value) if func is not None else None
        return fn is not None and fn.node is func and any(rank_guard(f, c) is not None for c in fn.calls)

    @staticmethod
    def _read_statement(f: ScriptFacts, call: cst.Call) -> cst.BaseStatement:
        """The statement to put the barrier before: the ``with`` whose items open the file the
        load reads (``with open(args.save, "rb") as fh: model = torch.load(fh)``), or the load's own."""
        stmt = f.statement(call)
        opener_names = {n.value for n in m.findall(call.args[0].value, m.Name())}
        for parent in f.ancestors(call):
            if isinstance(parent, cst.With) and any(
                    isinstance(item.asname, cst.AsName) and isinstance(item.asname.name, cst.Name)
                    and item.asname.name.value in opener_names for item in parent.items):
                return parent
            if isinstance(parent, (cst.FunctionDef, cst.Module)):
                break
        return stmt

    @staticmethod
    def _statement(f: ScriptFacts, call: cst.Call, options) -> Optional[cst.BaseStatement]:
        """The statement to guard: the outermost ``with`` whose items open the file, or the
        simple statement; None when it binds names (they would be unbound on other ranks) or
        when the ``with`` does more than write (``with open(log, "a") as fh: main(args, fh)``:
        on rank 0 alone, the others would not train)."""
        stmt = f.statement(call)
        for parent in f.ancestors(call):
            if isinstance(parent, cst.With) and any(call is item.item or call in m.findall(item, m.Call())
                                                    for item in parent.items):
                stmt = parent
                break
            if parent is stmt:
                break
        if isinstance(stmt, cst.SimpleStatementLine):
            if _downloads(call):
                return stmt  # under a `with`, the names it binds stay bound
            if all(isinstance(s, cst.Expr) for s in stmt.body):
                return stmt
            return None
        if isinstance(stmt, cst.With):
            binds = m.findall(stmt.body, m.Assign() | m.AugAssign() | m.AnnAssign() | m.For() | m.FunctionDef())
            if binds or any(f.qualnames(c) & set(_COLLECTIVE_CALLS) for c in m.findall(stmt.body, m.Call())):
                return None
            handles = {code(item.asname.name) for item in stmt.items if item.asname is not None}
            for s in stmt.body.body:
                calls = [s.body[0].value] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 \
                    and isinstance(s.body[0], cst.Expr) and isinstance(s.body[0].value, cst.Call) else []
                if not calls or not all(
                        _is_writer(f, c, options) or f.qualnames(c) & {"builtins.print"}
                        or isinstance(c.func, cst.Attribute) and code(c.func.value) in handles for c in calls):
                    return None
            return stmt
        return None

    @staticmethod
    def _inside_other(f: ScriptFacts, stmt: cst.BaseStatement, guarded) -> bool:
        return any(id(a) in guarded for a in f.ancestors(stmt))

    @staticmethod
    def _unwrap_model(ctx: RuleContext, p, call: cst.Call) -> None:
        f = ctx.facts
        obj = call.args[0].value if call.args else None
        if obj is None or p.group_of(f, f.key_of(obj)) is None:
            return
        if ctx.options.accelerate:
            return  # Accelerate's model is the module on one process, unwrapped on several (fabric/_setups.py)
        ctx.edits.replace(obj, lambda u: cst.Attribute(value=u, attr=cst.Name("module")))
        ctx.change(call, f"`torch.save({short(obj)}, ...)` saves `{short(obj)}.module`, the script's own "
                         "module: Fabric's wrapper would not load back")
        group = p.group_of(f, f.key_of(obj))
        if group.forward_methods:
            # Fabric's redirection of a marked method (lightning/fabric/wrappers.py,
            # _redirection_through_forward) leaves the module's bound `forward` in its __dict__,
            # which pickles as `getattr` and does not load with weights_only (measured, 2 processes)
            ctx.edits.insert_before(f.statement(call), stmt(
                f'vars({code(obj)}.module).pop("forward", None)  # Fabric\'s patched forward would not load\n'))
            ctx.change(call, f"Fabric's bound `forward`, left by the redirection of "
                             f"{', '.join(f'`{n}`' for n in group.forward_methods)}, is dropped before "
                             f"saving `{short(obj)}.module`: pickled, it would not load back")

    def _apply(self, ctx: RuleContext, guarded) -> None:
        f = ctx.facts
        guarded.sort(key=lambda g: (f.line(g[0])))
        runs: list[list[tuple[cst.BaseStatement, str, str]]] = []
        for item in guarded:
            last = runs[-1][-1] if runs else None
            if last is not None and last[2] == item[2] and last[1] == item[1] \
                    and f.block(last[0]) is f.block(item[0]) \
                    and _next_in_block(f, last[0]) is item[0]:
                runs[-1].append(item)
            else:
                runs.append([item])
        for run in runs:
            stmts = [s for s, _, _ in run]
            ref, what = run[0][1], run[0][2]
            if what == "download":
                _enclose(ctx, stmts, lambda inner, r=ref: cst.With(
                    items=[cst.WithItem(expr(f"{r}.rank_zero_first()"))], body=cst.IndentedBlock(body=inner)))
                ctx.change(stmts[0], f"the download runs on rank 0 first (`with {ref}.rank_zero_first():`), "
                                     "the other processes read what it fetched")
            elif what == "prepare":
                # rank 0 alone (a second fetch or unpacking would rewrite the files another
                # process reads), then every process waits for it
                following = _next_in_block(f, stmts[-1])
                lines = ", ".join(str(f.line(s)) for s in stmts)
                if following is not None:
                    _enclose(ctx, stmts, lambda inner, r=ref: cst.If(
                        test=expr(f"{r}.is_global_zero"), body=cst.IndentedBlock(body=inner)))
                    ctx.edits.insert_before(following, stmt(f"{ref}.barrier()\n").with_changes(
                        leading_lines=following.leading_lines))
                    ctx.edits.replace(following, lambda u: u.with_changes(leading_lines=[]))
                    ctx.change(stmts[0], f"data prepared on rank 0 only (`if {ref}.is_global_zero:`, line(s) "
                                         f"{lines}), then `{ref}.barrier()`: the other processes read it once "
                                         "it is complete")
                else:  # the block's last statement: the barrier comes with the context manager
                    _enclose(ctx, stmts, lambda inner, r=ref: cst.With(
                        items=[cst.WithItem(expr(f"{r}.rank_zero_first()"))], body=cst.IndentedBlock(body=[cst.If(
                            test=expr(f"{r}.is_global_zero"), body=cst.IndentedBlock(body=inner))])))
                    ctx.change(stmts[0], f"data prepared on rank 0 only (`if {ref}.is_global_zero:` under "
                                         f"`{ref}.rank_zero_first()`, line(s) {lines}): the other processes "
                                         "wait for it, and read it once it is complete")
            else:
                ctx.edits.wrap(stmts, lambda inner, r=ref: cst.If(
                    test=expr(f"{r}.is_global_zero"), body=cst.IndentedBlock(body=inner)))
                lines = ", ".join(str(f.line(s)) for s in stmts)
                ctx.change(stmts[0], f"writes on rank 0 only (`if {ref}.is_global_zero:`): line(s) {lines}")


def _light(f: ScriptFacts, func: cst.FunctionDef) -> bool:
    """A function whose call may run on rank 0 alone: it runs no model and draws no loader (an
    evaluation that also prints would leave the other processes out of its collectives)."""
    return not any(f.kinds_of(c.func) & {MODEL, LOADER} or any(f.kinds_of(a.value) & {LOADER} for a in c.args)
                   for c in f.find_in(func, m.Call())) and not any(
        f.kinds_of(loop.iter) & {LOADER} for loop in f.find_in(func, m.For()))


def _enclose(ctx: RuleContext, stmts: list[cst.BaseStatement], make) -> None:
    """``make(stmts)`` in their place. One statement is replaced by it, so that what another rule
    puts before it (Fabric's creation, where it is the anchor) stays before it; several are
    wrapped."""
    if len(stmts) > 1:
        ctx.edits.wrap(stmts, make)
        return
    ctx.edits.replace(stmts[0], lambda u: make([u.with_changes(leading_lines=[])]).with_changes(
        leading_lines=u.leading_lines))


def _next_in_block(f: ScriptFacts, stmt: cst.BaseStatement) -> Optional[cst.BaseStatement]:
    body = list(f.block(stmt).body)
    index = body.index(stmt)
    return body[index + 1] if index + 1 < len(body) else None
