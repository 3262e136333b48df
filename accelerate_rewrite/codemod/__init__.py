# every path into the engine imports libcst.matchers (its rules are written with them): here,
# first, without the docstrings that take 50-130 ms of the start (codemod/tree/startup.py)
from accelerate_rewrite.codemod.tree.startup import import_matchers

import_matchers()
