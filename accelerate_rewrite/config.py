"""``[tool.accelerate-rewrite]`` in pyproject.toml, rule selection, and what applies to a file.

The configuration of a file is the closest ``pyproject.toml`` with a ``[tool.accelerate-rewrite]``
table, found by walking up from the file's folder (as ruff does). Keys (dashes or underscores):

    precision, devices, strategy, num-nodes, accelerator, backend, matmul-precision,
    clip-grad-norm, accumulate, keep-effective-batch, freeze, checkpointing,
    optimizer-8bit, paged-optimizer, compile, dynamic-padding, group-by-length the options
    select, ignore       rules by code ("AR201"), code prefix ("AR1"), name
                         ("amp-api-migration"), "fixes" or "ALL"
    exclude              globs of paths (relative to the config's folder) never rewritten
    follow-imports       true: the project's own modules a script imports may change with it
                         even when not among the paths given (as --follow-imports); false:
                         only the paths given change (as --no-follow-imports); unset: those
                         whose changed names no other file under the script's folder reads
    [[tool.accelerate-rewrite.overrides]]
    paths = ["legacy/*.py"]   and any key above but exclude: for the files the globs match

Command-line flags win over the configuration; overrides win over the table's own keys.
An unknown key, a bad value or an unknown rule is a ConfigError naming it and the file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from accelerate_rewrite.options import OptionError, Options, normalize_glob

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TABLE = "accelerate-rewrite"
#: option keys, as Options.create names them
OPTION_KEYS = ("precision", "devices", "strategy", "num_nodes", "accelerator", "backend",
               "matmul_precision", "clip_grad_norm", "accumulate", "keep_effective_batch", "freeze",
               "checkpointing", "optimizer_8bit", "paged_optimizer", "compile", "dynamic_padding",
               "group_by_length", "shard_eval")
#: option keys that are flags: true or false in the configuration
FLAG_KEYS = ("keep_effective_batch", "optimizer_8bit", "paged_optimizer", "compile", "dynamic_padding",
             "shard_eval", "follow_imports")
SELECTION_KEYS = ("select", "ignore")
KEYS = (*OPTION_KEYS, *SELECTION_KEYS, "exclude", "follow_imports", "overrides")
#: the selector of the migrations and bug fixes (the pre-commit hook's default)
FIXES = "fixes"


class ConfigError(ValueError):
    """A wrong configuration: the message names the file and the key."""


@dataclass(frozen=True)
class Config:
    path: Optional[Path] = None  # the pyproject.toml, None when there is none
    values: dict = field(default_factory=dict)  # option and selection keys, underscored
    exclude: tuple[str, ...] = ()
    overrides: tuple[tuple[tuple[str, ...], dict], ...] = ()

    @property
    def root(self) -> Optional[Path]:
        return self.path.parent if self.path is not None else None

    def relative(self, file: Path) -> str:
        try:
            return Path(file).resolve().relative_to(self.root.resolve()).as_posix()
        except (ValueError, AttributeError, OSError):
            return Path(file).as_posix()

    def excluded(self, file: Path) -> bool:
        rel = self.relative(file)
        return any(fnmatch.fnmatch(rel, g) or rel.startswith(g.rstrip("/") + "/") for g in self.exclude)

    def values_for(self, file: Path) -> dict:
        """The table's values with the overrides whose globs match ``file`` applied."""
        out = dict(self.values)
        rel = self.relative(file)
        for globs, values in self.overrides:
            if any(fnmatch.fnmatch(rel, g) for g in globs):
                out.update(values)
        return out


def _key(raw: str) -> str:
    return raw.replace("-", "_")


def _check_values(table: dict, where: str, allowed: Sequence[str], base: Optional[dict] = None) -> dict:
    """The table's values, underscored and checked; options are validated over ``base`` (an
    override's over the table's own)."""
    out: dict = {}
    for raw, value in table.items():
        key = _key(raw)
        if key not in allowed:
            valid = ", ".join(k.replace("_", "-") for k in allowed)
            raise ConfigError(f"{where}: unknown key {raw!r}; valid keys: {valid}")
        if key in FLAG_KEYS and not isinstance(value, bool):
            raise ConfigError(f"{where}: {raw} must be true or false")
        if key in SELECTION_KEYS or key in ("freeze", "exclude"):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: {raw} must be a list of strings")
            value = tuple(value)
        if key == "exclude":
            try:
                value = tuple(normalize_glob(g, "exclude") for g in value)
            except OptionError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if key in SELECTION_KEYS:
            try:
                select_rules(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {raw}: {exc}") from None
        out[key] = value
    options = {k: v for k, v in {**(base or {}), **out}.items() if k in OPTION_KEYS}
    try:
        Options.create(**options)
    except OptionError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return out


@lru_cache(maxsize=None)
def load(path: Path) -> Config:
    """The ``[tool.accelerate-rewrite]`` table of one pyproject.toml."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: can't be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    table = data.get("tool", {}).get(TABLE)
    if table is None:
        return Config()
    where = f"{path}: [tool.{TABLE}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    overrides_raw = table.get("overrides", [])
    values = _check_values({k: v for k, v in table.items() if k not in ("overrides",)}, where,
                           [k for k in KEYS if k != "overrides"])
    exclude = values.pop("exclude", ())
    overrides = []
    if not isinstance(overrides_raw, list):
        raise ConfigError(f"{where}: overrides must be an array of tables ([[tool.{TABLE}.overrides]])")
    for index, entry in enumerate(overrides_raw):
        here = f"{path}: [[tool.{TABLE}.overrides]] #{index + 1}"
        if not isinstance(entry, dict) or "paths" not in entry:
            raise ConfigError(f"{here}: needs paths = [\"glob\", ...]")
        globs = entry["paths"]
        if isinstance(globs, str):
            globs = [globs]
        if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
            raise ConfigError(f"{here}: paths must be a list of globs")
        try:
            globs = [normalize_glob(g, "paths") for g in globs]
        except OptionError as exc:
            raise ConfigError(f"{here}: {exc}") from None
        rest = _check_values({k: v for k, v in entry.items() if k != "paths"}, here,
                             [*OPTION_KEYS, *SELECTION_KEYS], base=values)
        overrides.append((tuple(globs), rest))
    return Config(path, values, tuple(exclude), tuple(overrides))


@lru_cache(maxsize=None)
def _find(folder: Path) -> Optional[Path]:
    for candidate in (folder, *folder.parents):
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file():
            try:
                text = pyproject.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            try:  # any TOML form of the table: [tool.accelerate-rewrite], tool = {...}, dotted keys
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError:
                if TABLE in text:
                    return pyproject  # load() says what is wrong with it
                continue
            tool = data.get("tool")
            if isinstance(tool, dict) and TABLE in tool:
                return pyproject
    return None


def config_for(file: Path) -> Config:
    """The configuration that applies to ``file`` (an empty one when no pyproject has it)."""
    found = _find(Path(file).resolve().parent)
    return load(found) if found is not None else Config()


def fixes(options: Optional[Options] = None) -> set[str]:
    """The rules marked ``fix``, with the partners they rely on under ``options``: apex's
    migration brings the native rules with the torch backend; with Fabric it would bring the
    whole conversion, so it is not a fix there."""
    from accelerate_rewrite.rules import ALL_RULES, BY_CODE
    from accelerate_rewrite.rules.base.plan import FabricRule

    out: set[str] = set()
    for rule in ALL_RULES:
        if not rule.fix:
            continue
        closure, todo = {rule.code}, [rule.code]
        while todo and options is not None:
            for code in BY_CODE[todo.pop()].requirements(options):
                if code not in closure:
                    closure.add(code)
                    todo.append(code)
        if not any(isinstance(BY_CODE[c], FabricRule) for c in closure):
            out |= closure
    return out


def select_rules(selectors: Sequence[str], options: Optional[Options] = None) -> set[str]:
    """The codes a list of selectors names; a ConfigError names the one that names nothing."""
    from accelerate_rewrite.rules import ALL_RULES

    out: set[str] = set()
    for raw in selectors:
        key = raw.strip()
        if key.upper() == "ALL":
            hits = {r.code for r in ALL_RULES}
        elif key.lower() == FIXES:
            hits = fixes(options)
        else:
            hits = {r.code for r in ALL_RULES if r.code.startswith(key.upper()) or r.name == key.lower()}
        if not hits:
            raise ConfigError(f"unknown rule {raw!r}: give a code (AR201), a code prefix (AR2), "
                              f"a name (amp-api-migration), {FIXES!r} or 'ALL' "
                              "(`accelerate-rewrite rules` lists them)")
        out |= hits
    return out


@dataclass(frozen=True)
class Choice:
    """What applies to one file: the options and the rules (in their order)."""

    options: Options
    rules: tuple
    excluded: bool = False
    #: the project's modules the file imports may change with it (``follow-imports``): True,
    #: False, or None (not configured: those that no other file imports, plan.projects)
    follow_imports: Optional[bool] = None


def raw_values(file: Path, cli: dict[str, Any], *, defaults: Optional[dict] = None,
               isolated: bool = False) -> tuple[Config, dict, dict]:
    """The configuration of ``file``, the values that apply to it (``defaults``, then the
    configuration, then the command line's values that were given) before they are resolved
    into options and rules, and those given values. What ``choose`` resolves, and what the
    cache keys a result by (without loading the rules)."""
    config = Config() if isolated else config_for(file)
    values = {"select": ("ALL",), **(defaults or {})}
    values.update(config.values_for(file))
    given = {k: v for k, v in cli.items() if v not in (None, (), [], False)}
    values.update(given)
    return config, values, given


def choose(file: Path, cli: dict[str, Any], *, defaults: Optional[dict] = None,
           isolated: bool = False) -> Choice:
    """What applies to ``file``: ``defaults`` (the pre-commit hook's: the fixes, with the torch
    backend), then its configuration, then the command line's values (those given: not None,
    not empty)."""
    from accelerate_rewrite.rules import ALL_RULES

    config, values, given = raw_values(file, cli, defaults=defaults, isolated=isolated)
    options = {k: v for k, v in values.items() if k in OPTION_KEYS}
    try:
        opts = Options.create(**options)
    except OptionError as exc:
        where = f"{config.path}: " if config.path is not None and not set(options) <= set(given) else ""
        raise ConfigError(f"{where}{exc}") from None
    selected = select_rules(values["select"], opts)
    ignored = select_rules(values["ignore"], opts) if values.get("ignore") else set()
    rules = tuple(r for r in ALL_RULES if r.code in selected - ignored)
    named = {str(s).strip() for s in values["select"]}
    explicit = frozenset(r.code for r in rules if r.code in {n.upper() for n in named} or r.name in named)
    if explicit:
        opts = dataclasses.replace(opts, explicit=explicit)
    return Choice(opts, rules, excluded=config.excluded(file),
                  follow_imports=values.get("follow_imports"))
