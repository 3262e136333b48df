"""The engine's flow-sensitive check (codemod/tree/flow.py): no output reads a name that some path
leaves unbound where the input bound it on every path."""

from __future__ import annotations

import textwrap

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.tree.flow import maybe_unbound
from accelerate_rewrite.options import Options


def test_names_bound_on_only_some_paths():
    found = maybe_unbound(textwrap.dedent("""\
        def main(args):
            if args.flag:
                optimizer = 1
            print(optimizer)                      # 4: only under the flag
            for x in range(3):
                y = x
            print(y)                              # 7: the loop may not run
            try:
                import apex
            except ImportError:
                apex = None
            print(apex)                           # bound on both paths
            with open("f") as fh:
                w = 1
            print(w, fh)                          # a with body runs
            del w
            print(w)                              # 17: deleted
            if args.other:
                z = 1
            else:
                raise SystemExit
            print(z)                              # the other branch does not fall through
            def inner():
                return late                       # read when called, not here
            late = 1
            return [k for k in range(3)]
    """))
    assert found == {("<module>.main", "optimizer"): [4], ("<module>.main", "y"): [7],
                     ("<module>.main", "w"): [17]}


CONDITIONAL = """\
import argparse
import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--use-optimizer", action="store_true")
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(4, 1).to(device)
if args.use_optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
for x, y in loader:
    x, y = x.to(device), y.to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if args.use_optimizer:
        optimizer.zero_grad()
    else:
        model.zero_grad()
    loss.backward()
    if args.use_optimizer:
        optimizer.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-args.lr)
"""


def test_an_optimizer_built_under_a_flag_is_set_up_on_both_paths():
    """Set up inside the ``if`` only, the model would stay not set up when the flag is off (its
    batches on the GPU, itself on the CPU); set up after it, ``optimizer`` may be unbound. So
    the model is set up with the optimizer in the ``if``, and alone in a new ``else``
    (issue 14.4): nothing reads a name some path leaves unbound, and the flow check passes."""
    result = rewrite(CONDITIONAL, Options())
    assert not result.dropped, result.dropped
    assert ("if args.use_optimizer:\n    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)\n"
            "    model, optimizer = fabric.setup(model, optimizer)\nelse:\n    model = fabric.setup(model)\n"
            in result.output)


def test_the_flow_check_still_refuses_a_setup_after_a_conditional_binding():
    """An ``elif`` chain is not one of the shapes the rules set up per branch: the setup goes
    after it, and the flow check drops the rule that reads the maybe-unbound name."""
    source = CONDITIONAL.replace("if args.use_optimizer:\n    optimizer =",
                                 "if args.lr > 1:\n    pass\nelif args.use_optimizer:\n    optimizer =")
    result = rewrite(source, Options())
    assert not result.changed
    [dropped] = [d for d in result.dropped if d.startswith("AR103")]
    assert "it reads `optimizer`" in dropped and "some path leaves it unbound" in dropped


def test_bound_on_every_path_converts():
    source = CONDITIONAL.replace("if args.use_optimizer:\n    optimizer =", "if True:\n    optimizer =")
    source = source.replace("if True:\n    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)",
                            "optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)")
    result = rewrite(source, Options())
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output and not result.dropped


def test_a_name_bound_inside_a_function_is_not_a_local_of_the_module():
    # ``len`` bound in f is f's: the module's read of the builtin is bound (it was reported)
    assert maybe_unbound("def f():\n    len = 3\n    return len\nprint(len([1]))\n") == {}
    # nor is a nested function's local the outer function's
    source = "def outer():\n    def inner():\n        x = 1\n        return x\n    print(x)\n    return inner\n"
    assert maybe_unbound(source) == {}


def _every_source():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "fixtures"
    inputs = sorted(root.glob("*/input.py"))  # and a result of each (the reads the rewrites add)
    return inputs + [p for i in inputs for p in sorted(i.parent.glob("expected/*.py"))[:1]]


def test_the_module_given_statement_by_statement_reads_as_the_whole():
    """flow.unbound_in over a module's top-level statements (codemod/tree/layout.py's pieces), each
    parsed alone, finds what maybe_unbound finds in the whole file, line for line; asked only
    into some statements, it finds the module's reads and theirs."""
    import libcst as cst

    from accelerate_rewrite.codemod.tree.flow import unbound_in
    from accelerate_rewrite.codemod.tree.layout import Layout

    compared = 0
    for path in _every_source():
        text = path.read_text(encoding="utf-8")
        try:
            layout = Layout(cst.parse_module(text))
        except cst.ParserSyntaxError:
            continue
        if layout.code != text:
            continue
        pieces = layout.pieces()
        whole = maybe_unbound(text)
        assert unbound_in([(code, line, True) for code, line in pieces], {}) == whole, path
        some = unbound_in([(code, line, i % 2 == 0) for i, (code, line) in enumerate(pieces)], {})
        even = {line for i, (_, line) in enumerate(pieces) if i % 2 == 0}

        def piece_of(line: int) -> int:
            return max(start for _, start in pieces if start <= line)
        expected = {}
        for (scope, name), lines in whole.items():
            kept = [n for n in lines if scope == "<module>" or piece_of(n) in even]
            if kept:
                expected[(scope, name)] = kept
        assert some == expected, path
        compared += bool(whole)
    assert compared >= 5  # fixtures with reads that some path leaves unbound
