"""Issue 57: every change record describes the file as written (codemod/claims.py). A note that
says a statement was removed, or that code became other code, goes where the file still runs
what it claims is gone, or holds nothing of what it claims the code became."""

from __future__ import annotations

import textwrap

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.analysis.syntax import code
from accelerate_rewrite.codemod.edits.edit_set import EditSet, apply_edits
from accelerate_rewrite.codemod.claims import true_claims
from accelerate_rewrite.codemod.result import Note
from accelerate_rewrite.options import Options

SOURCE = textwrap.dedent("""\
    import torch


    def init(args):
        torch.cuda.set_device(args.gpu)
        rank = torch.distributed.get_rank()
        checkpoint = torch.load(args.path, map_location="cuda:" + str(torch.distributed.get_rank()))
        return rank, checkpoint
""")


def _notes(*lines_messages):
    return [Note("AR111", line, message) for line, message in lines_messages]


def test_a_removal_the_file_still_runs_with_fabric_is_no_claim():
    kept = SOURCE.replace("def init(args):", "def init(args, fabric=None):")
    notes = _notes((5, "removed `torch.cuda.set_device(args.gpu)`: Fabric starts and ends the processes"))
    assert true_claims(notes, SOURCE, kept) == []
    guarded = kept.replace("    torch.cuda.set_device(args.gpu)\n",
                           "    if fabric is None:\n        torch.cuda.set_device(args.gpu)\n")
    assert true_claims(notes, SOURCE, guarded) == notes  # run without `fabric` only: true
    removed = kept.replace("    torch.cuda.set_device(args.gpu)\n", "")
    assert true_claims(notes, SOURCE, removed) == notes


def test_a_replacement_an_outer_edit_rebuilt_without_it_is_swallowed():
    """``torch.load(path, map_location=... get_rank() ...)`` rebuilt as ``fabric.load(path)``
    from text: the inner ``get_rank()`` -> ``fabric.global_rank`` never reached the file. An
    outer edit built from the updated node (its code kept) swallows nothing."""
    module = cst.parse_module(SOURCE)
    load = next(c for c in m.findall(module, m.Call(func=m.Attribute(attr=m.Name("load")))))
    rank = next(c for c in m.findall(load, m.Call(func=m.Attribute(attr=m.Name("get_rank")))))
    inner = EditSet()
    inner.replace(rank, lambda u: cst.parse_expression("fabric.global_rank"))
    outer = EditSet()
    outer.replace(load, lambda u: cst.parse_expression(f"fabric.load({code(u.args[0].value)})"))
    swallowed: set[int] = set()
    out = apply_edits(module, [inner, outer], swallowed=swallowed).code
    assert "fabric.load(args.path)" in out and swallowed == {id(rank)}
    kept = EditSet()
    kept.replace(load, lambda u: u.with_changes(func=cst.parse_expression("fabric.load")))
    swallowed.clear()
    out = apply_edits(module, [inner, kept], swallowed=swallowed).code
    assert 'fabric.load(args.path, map_location="cuda:" + str(fabric.global_rank))' in out and not swallowed


def test_the_notes_of_a_rewrite_hold_in_its_output():
    """Through the engine: a torchrun script's checkpoint loaded on its own GPU. AR109 makes the
    load ``fabric.load(path)`` (no map_location); the rank read inside it went with it, so its
    note goes, and every note that stays is true of the output."""
    source = textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        checkpoint = torch.load("ckpt.pt", map_location="cuda:" + str(dist.get_rank()))
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    result = rewrite(source, Options.create(), path="train.py")
    assert 'checkpoint = fabric.load("ckpt.pt")' in result.output
    assert not [n for n in result.changes if "get_rank" in n.message]
    assert [n for n in result.changes if n.rule == "AR109"]
