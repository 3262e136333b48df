from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.plan import short

#: slow tokenizer classes of transformers that have a fast (Rust, `tokenizers`) counterpart
#: named ``<Name>Fast``, with the same vocabulary files and the same ``__call__`` output
SLOW = frozenset({
    "AlbertTokenizer", "BartTokenizer", "BertTokenizer", "BigBirdTokenizer", "BlenderbotTokenizer",
    "CamembertTokenizer", "CLIPTokenizer", "DebertaTokenizer", "DebertaV2Tokenizer",
    "DistilBertTokenizer", "ElectraTokenizer", "FunnelTokenizer", "GPT2Tokenizer",
    "HerbertTokenizer", "LayoutLMTokenizer", "LEDTokenizer", "LlamaTokenizer",
    "LongformerTokenizer", "MBartTokenizer", "MobileBertTokenizer", "MPNetTokenizer",
    "PegasusTokenizer", "RemBertTokenizer", "RobertaTokenizer", "SqueezeBertTokenizer",
    "T5Tokenizer", "XLMRobertaTokenizer", "XLNetTokenizer",
})
AUTO = ("transformers.AutoTokenizer.from_pretrained",
        "transformers.models.auto.tokenization_auto.AutoTokenizer.from_pretrained")
#: attributes only slow (SentencePiece / Python) tokenizers have
SLOW_ONLY = ("sp_model", "sp_model_kwargs")


class FastTokenizer(Rule):
    """Hugging Face tokenizers in their fast (Rust) form.

    What it does:
    - `AutoTokenizer.from_pretrained(name, use_fast=False)`: the `use_fast=False` goes (the fast
      tokenizer is the default);
    - a slow tokenizer class that has a fast counterpart (`BertTokenizer`, `RobertaTokenizer`,
      `T5Tokenizer`, ... 28 of them) becomes it (`BertTokenizerFast`), in the import and at
      each use.

    Why: tokenizing in Python is often what keeps the GPU waiting in NLP training; the fast
    tokenizers run batches in Rust, tens of times faster, and give offsets and word ids too.

    Kind: approximate: on ordinary text both produce the same ids; they can differ on rare
    inputs (unusual whitespace or unicode normalisation), so the verifier compares losses with
    a tolerance.

    Leaves alone (and says why): `use_fast` given by a variable, and scripts that use what only
    slow tokenizers have (`sp_model`).
    """

    code = "AR501"
    name = "fast-tokenizer"
    kind = Kind.APPROXIMATE
    words = ("tokenizer", "use_fast")
    examples = (Example.from_files("AR501", options={"backend": "torch"}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f, e = ctx.facts, ctx.edits
        refs = []  # (the node that names the class, its qualified name): `BertTokenizer` in
        for node, q in f.qualified_refs:  # `BertTokenizer.from_pretrained`, or the import's name
            parts = q.split(".")
            index = next((i for i, part in enumerate(parts) if part in SLOW), None)
            if not q.startswith("transformers.") or index is None:
                continue
            for _ in range(len(parts) - index - 1):
                node = node.value if isinstance(node, cst.Attribute) else node
            refs.append((node, ".".join(parts[:index + 1])))
        autos = [c for c in f.calls_named(*AUTO)
                 if any(a.keyword and a.keyword.value == "use_fast" for a in c.args)]
        if not refs and not autos:
            return
        slow_only = next(iter(f.find(m.Attribute(attr=m.Name(SLOW_ONLY[0]) | m.Name(SLOW_ONLY[1])))),
                         None)
        if slow_only is not None:
            ctx.skip(slow_only, f"`{short(slow_only)}` exists on slow tokenizers only: tokenizers left as they are")
            return
        for call in autos:
            arg = next(a for a in call.args if a.keyword and a.keyword.value == "use_fast")
            if not m.matches(arg.value, m.Name("False")):
                if not m.matches(arg.value, m.Name("True")):
                    ctx.skip(call, f"`use_fast={short(arg.value)}` is decided at run time: left as is")
                continue
            e.replace(call, lambda u: _without(u, "use_fast"))
            ctx.change(call, "`use_fast=False` removed: AutoTokenizer loads the fast tokenizer")
        imported: set[str] = set()
        for node, qualname in refs:
            slow = qualname.rsplit(".", 1)[-1]
            fast = slow + "Fast"
            parent = f.parent(node)
            if isinstance(parent, (cst.ImportAlias, cst.Import, cst.ImportFrom)):
                continue  # the import itself: AddImports / RemoveImports below
            if isinstance(node, cst.Name):
                if node.value != slow:
                    ctx.skip(node, f"`{node.value}` is `{slow}` under another name: left as is")
                    continue
                e.replace(node, cst.Name(fast))
                if slow not in imported:
                    imported.add(slow)
                    e.add_import("transformers", fast)
                    e.remove_import_if_unused("transformers", slow)
            elif isinstance(node, cst.Attribute) and node.attr.value == slow:
                e.replace(node, lambda u, new=fast: u.with_changes(attr=cst.Name(new)))
            else:
                continue
            ctx.change(node, f"`{slow}` became `{fast}` (the Rust tokenizer, same vocabulary)")


def _without(call: cst.Call, keyword: str) -> cst.Call:
    args = [a for a in call.args if not (a.keyword and a.keyword.value == keyword)]
    if args and len(args) < len(call.args) and call.args[-1].keyword and call.args[-1].keyword.value == keyword:
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)  # keep the original ending
    return call.with_changes(args=args)
