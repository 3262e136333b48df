"""Which keys hold the same object (a part of ScriptFacts, codemod/analysis/facts.py): values flow through
plain assignments, call arguments into the parameters of functions and classes of the script,
methods called on an object of a class of the script (``trainer.train(train_loader)``), and
``self.x = param``; keys joined so share one set of kinds."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.arguments import keywords
from accelerate_rewrite.codemod.analysis.kinds import MODEL, Key, hand_updated
from accelerate_rewrite.codemod.analysis.syntax import init_of, param_for, positional_params


class Flow:
    """ScriptFacts' flow of objects between keys (``self`` is the ScriptFacts)."""

    def _flow(self) -> None:
        """Keys joined by a flow (an alias, an argument into a parameter, ``self.x = param``)
        share one set of kinds; keys hold the same object (``same_object``) where a name's
        aliases all give it one object, or a parameter's calls all pass it one (a parameter given
        a student in one call and a teacher in another holds neither: ``Wrapper(student, ...)``,
        ``Wrapper(teacher, ...)``; nor does ``_`` in ``_, _ = get_loaders()``)."""
        find, seen, self._identity, self._passed = self._joined()

        by_root: dict[Key, set[str]] = {}
        for b in self.bindings:
            by_root.setdefault(find(b.key), set()).add(b.kind)
        trained = [key for opt in self.optimizers for key in opt.models]
        trained += [key for key, _ in hand_updated(self)]  # no optimizer: updated by hand
        for key in trained:
            by_root.setdefault(find(key), set()).add(MODEL)
        keys = seen | {b.key for b in self.bindings} | set(trained)
        for key in keys:
            self.kinds[key] = by_root.get(find(key), set())
        self._find = find

    def _joined(self):
        """The flows between keys as union-finds: (find of the kinds, every key a flow joins,
        find of the objects, and each parameter's keys its calls pass)."""
        kinds = _UnionFind()
        objects = _UnionFind()
        seen: set[Key] = set()

        def union(a: Optional[Key], b: Optional[Key]) -> None:
            if a is not None and b is not None:
                seen.update((a, b))
                kinds.union(a, b)

        by_param: dict[Key, list[Key]] = {}

        def into(param: Key, value: Optional[Key]) -> None:
            union(param, value)
            if value is not None:
                by_param.setdefault(param, []).append(value)

        by_name: dict[Key, list[Key]] = {}
        for target, value in self._aliases:
            key = self.key_of(value)
            union(target, key)
            if target is not None and key is not None:
                by_name.setdefault(target, []).append(key)
        for fn in self.functions.values():
            owner = fn.node if isinstance(fn.node, cst.FunctionDef) else init_of(fn.node)
            if owner is None:
                continue
            names = {p.name.value for p in [*owner.params.params, *owner.params.kwonly_params]}
            for call in fn.calls:
                for index, arg in enumerate(call.args):
                    param = param_for(fn.params, fn.node, arg, index)
                    if param is not None:
                        into((owner, param.name.value), self.key_of(arg.value))
                if any(arg.star == "**" for arg in call.args):  # ``training_loop(rank=0, **config)``
                    for name, value in (keywords(self, call) or {}).items():  # with config = dict(...)
                        if name in names and not any(a.keyword is not None and a.keyword.value == name
                                                     for a in call.args):
                            into((owner, name), self.key_of(value))
        for sub, base in self._subclasses():  # pytorch-template's ``class Trainer(BaseTrainer)``
            init, base_init = init_of(sub), init_of(base)
            for call in (self.find_in(init, m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")),
                                                                   attr=m.Name("__init__"))))
                         if init is not None and base_init is not None else ()):
                for index, arg in enumerate(call.args):  # ``super().__init__(model, ..., optimizer, config)``
                    param = param_for(positional_params(base), base, arg, index)
                    if param is not None:
                        into((base_init, param.name.value), self.key_of(arg.value))
            attrs: dict[str, list[Key]] = {}
            for node in self._self_attrs:  # ``self.optimizer`` is the same attribute in both
                key = self.key_of(node)
                if key is not None and key[0] in (sub, base):
                    attrs.setdefault(key[1], []).append(key)
            for keys in attrs.values():
                for key in keys[1:]:
                    union(keys[0], key)
                    if key != keys[0]:
                        by_name.setdefault(key, []).append(keys[0])
        for call, method in self._method_calls_of_objects():  # ``simclr.train(train_loader)``
            params = positional_params(method)[1:]  # without self
            for index, arg in enumerate(call.args):
                if arg.keyword is None and not arg.star and index < len(params):
                    into((method, params[index].name.value), self.key_of(arg.value))
                elif arg.keyword is not None:
                    named = [p for p in positional_params(method)[1:] if p.name.value == arg.keyword.value]
                    if named:
                        into((method, named[0].name.value), self.key_of(arg.value))
        changed = True
        while changed:  # a parameter holds what its calls pass, and a name what its assignments
            changed = False  # give it, when they all give one object (``_, _ = two_loaders()``: neither)
            for name, values in by_name.items():
                roots = {objects.find(v) for v in values} - {objects.find(name)}  # (``model = model.to(d)``)
                if len(roots) == 1:
                    objects.union(name, next(iter(roots)))
                    changed = True
            for param, values in by_param.items():
                roots = {objects.find(v) for v in values}
                if len(roots) == 1 and objects.find(param) != next(iter(roots)):
                    objects.union(param, next(iter(roots)))
                    changed = True
        return kinds.find, seen, objects.find, by_param

    def _subclasses(self) -> list[tuple[cst.ClassDef, cst.ClassDef]]:
        """(class, its base) for the classes of the program that derive from one of its own."""
        out = []
        for fn in self.functions.values():
            if isinstance(fn.node, cst.ClassDef):
                for base in fn.node.bases:
                    other = self.functions.get(base.value.value) if isinstance(base.value, cst.Name) else None
                    if other is not None and isinstance(other.node, cst.ClassDef) and other.node is not fn.node:
                        out.append((fn.node, other.node))
        return out

    def _method_calls_of_objects(self) -> list[tuple[cst.Call, cst.FunctionDef]]:
        """``obj.method(...)`` where ``obj = C(...)`` (its one assignment) is an object of a class
        of the script that defines ``method``: the call and the method."""
        out = []
        for call in self.attribute_calls:
            receiver = call.func.value
            if not isinstance(receiver, cst.Name):
                continue
            built = self.assigned_value(receiver)
            fn = self.functions.get(built.func.value) if isinstance(built, cst.Call) \
                and isinstance(built.func, cst.Name) else None
            if fn is None or not isinstance(fn.node, cst.ClassDef):
                continue
            method = next((s for s in fn.node.body.body if isinstance(s, cst.FunctionDef)
                           and s.name.value == call.func.attr.value), None)
            if method is not None and not any(m.matches(d.decorator, m.Name("staticmethod") | m.Name("classmethod")
                                                        | m.Name("property")) for d in method.decorators):
                out.append((call, method))
        return out

    def same_object(self, a: Optional[Key], b: Optional[Key]) -> bool:
        return a is not None and b is not None and self._identity(a) == self._identity(b)

    def may_hold(self, key: Optional[Key], other: Optional[Key]) -> bool:
        """``key`` holds ``other``'s object, or is a parameter that some call gives it among
        others (``evaluate(model, train_loader)`` and ``evaluate(model, val_loader)``: ``loader``
        holds neither, and may hold either)."""
        return self.same_object(key, other) or (key is not None and any(
            self.same_object(value, other) for value in self._passed.get(key, ())))

    def object_of(self, key: Key) -> Key:
        """The one key that stands for every key holding the same object as ``key``."""
        return self._identity(key)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Key, Key] = {}

    def find(self, k: Key) -> Key:
        parent = self.parent
        root = k
        while parent.get(root, root) != root:
            root = parent[root]
        while k != root:  # each key on the way now points at the root (the sets are the same)
            parent[k], k = root, parent[k]
        return root

    def union(self, a: Key, b: Key) -> None:
        self.parent[self.find(a)] = self.find(b)
