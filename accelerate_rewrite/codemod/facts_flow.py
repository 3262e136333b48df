"""Which keys hold the same object (a part of ScriptFacts, codemod/facts.py): values flow through
plain assignments, call arguments into the parameters of functions and classes of the script,
methods called on an object of a class of the script (``trainer.train(train_loader)``), and
``self.x = param``; keys joined so share one set of kinds."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts_kinds import MODEL, Key, hand_updated
from accelerate_rewrite.codemod.syntax import init_of, param_for, positional_params


class Flow:
    """ScriptFacts' flow of objects between keys (``self`` is the ScriptFacts)."""

    def _flow(self) -> None:
        """Keys joined by a flow (an alias, an argument into a parameter, ``self.x = param``)
        hold the same object: they share one set of kinds."""
        find, seen = self._joined()

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
        """The flows between keys as a union-find: (find, every key a flow joins)."""
        parent: dict[Key, Key] = {}

        def find(k: Key) -> Key:
            root = k
            while parent.get(root, root) != root:
                root = parent[root]
            while k != root:  # each key on the way now points at the root (the sets are the same)
                parent[k], k = root, parent[k]
            return root

        seen: set[Key] = set()

        def union(a: Optional[Key], b: Optional[Key]) -> None:
            if a is not None and b is not None:
                seen.update((a, b))
                parent[find(a)] = find(b)

        for target, value in self._aliases:
            union(target, self.key_of(value))
        for fn in self.functions.values():
            owner = fn.node if isinstance(fn.node, cst.FunctionDef) else init_of(fn.node)
            if owner is None:
                continue
            for call in fn.calls:
                for index, arg in enumerate(call.args):
                    param = param_for(fn.params, fn.node, arg, index)
                    if param is not None:
                        union((owner, param.name.value), self.key_of(arg.value))
        for call, method in self._method_calls_of_objects():  # ``simclr.train(train_loader)``
            params = positional_params(method)[1:]  # without self
            for index, arg in enumerate(call.args):
                if arg.keyword is None and not arg.star and index < len(params):
                    union((method, params[index].name.value), self.key_of(arg.value))
                elif arg.keyword is not None:
                    named = [p for p in positional_params(method)[1:] if p.name.value == arg.keyword.value]
                    if named:
                        union((method, named[0].name.value), self.key_of(arg.value))
        return find, seen

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
        return a is not None and b is not None and self._find(a) == self._find(b)

    def object_of(self, key: Key) -> Key:
        """The one key that stands for every key holding the same object as ``key``."""
        return self._find(key)
