from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import stmt


class Float32MatmulPrecision(Rule):
    """`--matmul-precision high`: let fp32 matmuls use TF32 with
    `torch.set_float32_matmul_precision("high")`.

    What it does: with `--matmul-precision high` (or `medium`), a script that stays in fp32
    (no `--precision`, or `32-true`) gets `torch.set_float32_matmul_precision(...)` right after
    its imports.

    Why: on Ampere and later GPUs, fp32 matrix multiplications then run on TF32 tensor cores:
    several times faster, with a 10-bit mantissa in the products (PyTorch's default is
    "highest", full fp32). Scripts in mixed precision gain little from it. On a CPU it changes
    nothing.

    Kind: approximate (matmul results change within TF32's precision on those GPUs).

    Leaves alone (and says why): scripts that already set the matmul precision or
    `torch.backends.cuda.matmul.allow_tf32`, and scripts rewritten to a lower precision.
    """

    code = "AR204"
    name = "float32-matmul-precision"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR204", options={"matmul_precision": "high"}),)

    def applies(self, options: Options) -> bool:
        return options.matmul_precision is not None

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        if o.precision not in (None, "32-true"):
            ctx.skip(None, f"--matmul-precision not added: the script is rewritten to {o.precision}, "
                           "where fp32 matmuls are few")
            return
        already = f.calls_to("torch.set_float32_matmul_precision") or [
            node for node, q in f.qualified_refs if q == "torch.backends.cuda.matmul.allow_tf32"
        ]
        if already:
            node = already[0].call if hasattr(already[0], "call") else already[0]
            ctx.skip(node, "the script already sets the fp32 matmul precision")
            return
        body = list(f.module.body)
        imports = [s for s in body if m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))]
        if not imports or not isinstance(body[0], cst.BaseStatement):
            return
        last = imports[-1]
        ctx.edits.insert_after(last, stmt(f'torch.set_float32_matmul_precision("{o.matmul_precision}")\n'))
        ctx.edits.add_import("torch")
        ctx.change(last, f'added torch.set_float32_matmul_precision("{o.matmul_precision}"): TF32 '
                         "matmuls on Ampere and later GPUs (no change on a CPU)")
