"""The statically padded datasets of a script, found once for AR502 (dynamic padding) and AR503
(length-grouped batches).

The shape recognised is the one of most hand-written fine-tuning scripts:

    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=128, return_tensors="pt")
    train_set = TensorDataset(enc["input_ids"], enc["attention_mask"], torch.tensor(labels))
    train_loader = DataLoader(train_set, batch_size=16, shuffle=True)

``enc`` is used only through ``enc["key"]`` in that TensorDataset, and the dataset only by
DataLoaders (and ``len``) in the same scope: then nothing else sees the padded tensors, and the
padding can move into the loader's collate function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DATALOADERS, ScriptFacts, code

TENSOR_DATASETS = ("torch.utils.data.TensorDataset", "torch.utils.data.dataset.TensorDataset")
#: ``padding=`` values that pad every sequence of the call to one length: the dataset's longest
#: (True, "longest": the whole dataset is one call) or max_length
STATIC = ('"max_length"', "'max_length'", "True", '"longest"', "'longest'")


@dataclass
class PaddedSet:
    tokenize: cst.Call  # tokenizer(texts, padding=..., ...)
    tokenizer: str  # how the tokenizer is spelled there
    dataset_call: Optional[cst.Call] = None  # TensorDataset(enc["input_ids"], ...)
    dataset: str = ""  # the name it is bound to
    fields: tuple = ()  # per TensorDataset argument: its tokenizer key, or None
    loaders: list[cst.Call] = field(default_factory=list)
    refusal: Optional[tuple[cst.CSTNode, str]] = None


def padded_sets(f: ScriptFacts) -> list[PaddedSet]:
    return f.memo("padded-sets", lambda: [_analyse(f, call) for call in _static_tokenizations(f)])


def _static_tokenizations(f: ScriptFacts) -> list[cst.Call]:
    out = []
    for call in f.find(m.Call()):
        padding = next((a for a in call.args if a.keyword is not None and a.keyword.value == "padding"), None)
        if padding is not None and code(padding.value) in STATIC:
            out.append(call)
    return out


def _uses(f: ScriptFacts, stmt: cst.CSTNode, name: str) -> list[cst.CSTNode]:
    scope = f.scope(stmt)
    return f.in_order(a.node for a in scope.accesses[name]) if scope is not None else []


def _analyse(f: ScriptFacts, call: cst.Call) -> PaddedSet:
    out = PaddedSet(call, code(call.func))
    padding = code(next(a for a in call.args if a.keyword is not None and a.keyword.value == "padding").value)

    def refuse(node: cst.CSTNode, why: str) -> PaddedSet:
        out.refusal = (node, f"`padding={padding}`: {why}")
        return out

    stmt = f.statement(call)
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())],
                                                                  value=m.Call())])) \
            or stmt.body[0].value is not call:
        return refuse(call, "its result is not kept in a name (enc = tokenizer(...))")
    enc = stmt.body[0].targets[0].target.value
    dataset_call = None
    for use in _uses(f, stmt, enc):
        sub = f.parent(use)
        arg = f.parent(sub) if isinstance(sub, cst.Subscript) else None
        parent = f.parent(arg) if isinstance(arg, cst.Arg) else None
        key = sub.slice[0].slice.value if isinstance(sub, cst.Subscript) and len(sub.slice) == 1 \
            and isinstance(sub.slice[0].slice, cst.Index) else None
        if not (isinstance(key, cst.SimpleString) and isinstance(parent, cst.Call)
                and f.qualnames(parent.func) & set(TENSOR_DATASETS)) or dataset_call not in (None, parent):
            return refuse(use, f"`{enc}` is used as more than `{enc}[\"key\"]` in one TensorDataset "
                               f"(`{code(f.statement(use)).strip()[:50]}`): the padded tensors may be needed")
        dataset_call = parent
    if dataset_call is None:
        return refuse(call, f"`{enc}` does not go into a TensorDataset")
    if any(a.keyword is not None or a.star for a in dataset_call.args):
        return refuse(dataset_call, "a TensorDataset with keyword or starred arguments")
    fields = []
    for a in dataset_call.args:
        if m.matches(a.value, m.Subscript(value=m.Name(enc))):
            fields.append(a.value.slice[0].slice.value.evaluated_value)
        else:
            fields.append(None)
    if "input_ids" not in fields:
        return refuse(dataset_call, "the TensorDataset holds no input_ids")
    ds_stmt = f.statement(dataset_call)
    if not m.matches(ds_stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])) \
            or ds_stmt.body[0].value is not dataset_call:
        return refuse(dataset_call, "the TensorDataset is not kept in a name")
    out.dataset_call, out.fields = dataset_call, tuple(fields)
    out.dataset = ds_stmt.body[0].targets[0].target.value
    for use in _uses(f, ds_stmt, out.dataset):
        arg = f.parent(use)
        parent = f.parent(arg) if isinstance(arg, cst.Arg) else None
        if isinstance(parent, cst.Call) and m.matches(parent.func, m.Name("len")):
            continue
        if isinstance(parent, cst.Call) and f.qualnames(parent.func) & set(DATALOADERS) \
                and (arg is parent.args[0] or (arg.keyword is not None and arg.keyword.value == "dataset")):
            if any(a.keyword is not None and a.keyword.value in ("collate_fn", "batch_sampler") or a.star
                   for a in parent.args):
                return refuse(parent, "its DataLoader already has a collate_fn or batch_sampler, or **kwargs")
            out.loaders.append(parent)
            continue
        return refuse(use, f"`{out.dataset}` is used outside a DataLoader (`{code(f.statement(use)).strip()[:50]}`): "
                           "its items would change from padded tensors to lists")
    if not out.loaders:
        return refuse(dataset_call, f"`{out.dataset}` goes into no DataLoader here")
    return out
