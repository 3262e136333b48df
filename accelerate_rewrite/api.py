"""The rewrite with every rule: where the engine (codemod/, which knows no rule) and the rules
(rules/) meet. The runner, the verifier, the benchmarks and the tests call this.

    result = rewrite(source, Options.create(precision="bf16-mixed"), path="train.py")
"""

from __future__ import annotations

from typing import Optional, Sequence

from accelerate_rewrite.codemod import engine
from accelerate_rewrite.codemod.engine import Result  # noqa: F401 (imported from here)
from accelerate_rewrite.codemod.reading import RewriteError  # noqa: F401 (imported from here)
from accelerate_rewrite.codemod.rule import Rule
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules import ALL_RULES, BY_CODE


def rewrite(source: str, options: Options, *, rules: Optional[Sequence[Rule]] = None, **kwargs) -> Result:
    """``codemod.engine.rewrite`` with the rules given (default: all of them) and the registry
    of every rule as its catalogue; ``kwargs``: path, check_idempotence, scope, sources. With
    ``--backend accelerate`` the result is spelled in Accelerate's API (rules/accelerate/spelling.py),
    imported only then: it brings ``libcst.codemod`` (for ``AddImportsVisitor``), whose package
    imports its command line's ``concurrent.futures`` and ``multiprocessing`` and its tests'
    ``unittest``, a tenth of a second that a Fabric run does not need."""
    spelling = None
    if options.accelerate:
        from accelerate_rewrite.rules.accelerate.spelling import SPELLING as spelling
    return engine.rewrite(source, options, rules=ALL_RULES if rules is None else rules, catalogue=BY_CODE,
                          spelling=spelling, **kwargs)
