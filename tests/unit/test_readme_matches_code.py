"""The README against the code, by enumeration: rules, CLI commands and options,
configuration keys, metrics and routes are listed from the code (never by hand here), and
each must be in the README; what the README names must exist.

Rules are found by an AST scan of ``leadgate/``, ``bots/``, ``outbox/`` and ``binding/``
(not by importing: the channel packages are slow to import, and most rules are string
arguments, not attributes). A rule is whatever flows into a rule slot: a ``rule=``
argument, the ``rule`` parameter of a function taking one (by position too, and its
default), or a ``"rule":`` key of a dict literal. The value is followed through string
constants, conditional expressions, module-level constants and dicts (``.get`` with its
default, subscripts), local variables and the ``return`` values of functions; an f-string
is a pattern (``{name}.range``). An error raised without a rule carries its class's
``code`` as the rule (:class:`leadgate.core.errors.LeadgateError`), so those codes count
too. A value the scan cannot follow fails the test: teach the scan rather than let a rule
go unlisted. The rules are checked against the README's Rules table (every rule is in it,
each f-string by one example at least, and it names nothing else), and every dotted,
rule-shaped name in the README's backticks must be a rule unless it is a configuration
key, a table column, a Python module or file, or in :data:`NOT_RULES`.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from leadgate.cli.parser import build_parser
from leadgate.core.clock import FakeClock
from leadgate.core.config import ModelSettings, Settings, load_settings
from leadgate.core.metrics import Metrics
from leadgate.database import schema

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("leadgate", "bots", "outbox", "binding")
README = REPO / "README.md"
EXAMPLE = REPO / "config.example.toml"

#: A dotted, rule-shaped name in backticks (``turn.busy``, ``flowRun.unreadable``).
DOTTED = re.compile(r"`([a-z][A-Za-z_]*(?:\.[a-z][A-Za-z_]*)+)`")

#: Dotted names in README backticks that are not rules and not found by the automatic
#: exclusions below (configuration keys, table columns, Python modules and files).
NOT_RULES = {
    # Slack Web API methods
    "chat.postMessage",
    "chat.update",
    "views.open",
    "auth.test",
    "conversations.history",
    "conversations.replies",
    # Slack Events API subscriptions
    "message.channels",
    "message.groups",
    "message.mpim",
    # the OpenAI object type of a chat completion
    "chat.completion",
    # JSON fields of requests and answers (REST, MCP)
    "requestInit.headers",
    "serverInfo.version",
    "error.data",
    "stream_options.include_usage",
    # names the README gives as gone (a rule renamed, a setting removed)
    "studio.busy",
    "server.console_secret",
}


# ------------------------------------------------------------------ README text


@cache
def readme() -> str:
    """The README's text."""
    return README.read_text(encoding="utf-8")


def mentioned(name: str) -> bool:
    """Whether the README names ``name`` as a word of its own (in backticks, a code block,
    a table: not inside a longer name)."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)", readme()) is not None


# ------------------------------------------------------------------ rules


@dataclass
class Found:
    """What the scan found: rule names, f-string patterns, values it could not follow."""

    rules: dict[str, set[str]] = field(default_factory=dict)  # rule -> files
    patterns: dict[str, str] = field(default_factory=dict)  # regex -> the f-string's form
    unfollowed: list[str] = field(default_factory=list)


class _Module:
    """One source file: its path from the repository root and its tree."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path.relative_to(REPO))
        self.tree = ast.parse(path.read_text(encoding="utf-8"), self.name)


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _walk(node: ast.AST, fn: Function | None = None) -> Iterator[tuple[ast.AST, Function | None]]:
    """Every node under ``node`` with the function it is in."""
    for child in ast.iter_child_nodes(node):
        yield child, fn
        yield from _walk(child, child if isinstance(child, Function) else fn)


class _RuleScan:
    """The scan of the module docstring, over every source file at once."""

    def __init__(self) -> None:
        self.modules = [
            _Module(p)
            for pkg in PACKAGES
            for p in sorted((REPO / pkg).rglob("*.py"))
            if "migrations" not in p.parts
        ]
        self.found = Found()
        #: top-level names of every module: a string constant or a dict literal
        self.globals: dict[str, list[ast.expr]] = {}
        self.functions: dict[str, list[tuple[_Module, Function]]]
        self.functions = {}
        self.classes: dict[str, tuple[list[str], str | None]] = {}  # name -> bases, code
        #: classes defining ``__init__``: whether it takes a ``rule``
        self.inits: dict[str, bool] = {}
        for m in self.modules:
            for top in m.tree.body:
                value = top.value if isinstance(top, ast.Assign | ast.AnnAssign) else None
                targets = (
                    top.targets
                    if isinstance(top, ast.Assign)
                    else [top.target]
                    if isinstance(top, ast.AnnAssign)
                    else []
                )
                for target in targets:
                    if isinstance(target, ast.Name) and value is not None:
                        self.globals.setdefault(target.id, []).append(value)
            for node in ast.walk(m.tree):
                if isinstance(node, Function):
                    self.functions.setdefault(node.name, []).append((m, node))
                elif isinstance(node, ast.ClassDef):
                    code = next(
                        (
                            s.value.value
                            for s in node.body
                            if isinstance(s, ast.Assign | ast.AnnAssign)
                            and isinstance(s.value, ast.Constant)
                            and isinstance(s.value.value, str)
                            and any(
                                isinstance(t, ast.Name) and t.id == "code"
                                for t in (s.targets if isinstance(s, ast.Assign) else [s.target])
                            )
                        ),
                        None,
                    )
                    bases = [ast.unparse(b) for b in node.bases]
                    self.classes[node.name] = (bases, code)
                    for init in node.body:
                        if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                            every = init.args.posonlyargs + init.args.args + init.args.kwonlyargs
                            self.inits[node.name] = any(a.arg == "rule" for a in every)

    # --------------------------------------------------------------- helpers

    def _errors(self) -> dict[str, str]:
        """Every error class (a subclass of LeadgateError, by name) and its code."""
        codes: dict[str, str] = {}

        def code_of(name: str, seen: frozenset[str] = frozenset()) -> str | None:
            if name == "LeadgateError":
                return self.classes[name][1]
            if name not in self.classes or name in seen:
                return None
            bases, code = self.classes[name]
            for base in bases:
                inherited = code_of(base, seen | {name})
                if inherited is not None:
                    return code or inherited
            return None

        def takes_rule(name: str) -> bool:
            # An error whose own __init__ takes no rule sets one itself (DatabaseDamaged).
            if name in self.inits:
                return self.inits[name]
            bases = self.classes.get(name, ([], None))[0]
            return all(takes_rule(b) for b in bases if b in self.classes)

        for name in self.classes:
            code = code_of(name)
            if code is not None and takes_rule(name):
                codes[name] = code
        return codes

    def _add(self, m: _Module, value: str) -> None:
        self.found.rules.setdefault(value, set()).add(m.name)

    def _follow(self, m: _Module, expr: ast.expr, fn: Function | None, depth: int = 0) -> None:
        """Record every rule ``expr`` (met in ``fn``) can be."""
        where = f"{m.name}:{getattr(expr, 'lineno', '?')} {ast.unparse(expr)}"
        if depth > 8:
            self.found.unfollowed.append(where)
        elif isinstance(expr, ast.Constant):
            if isinstance(expr.value, str):
                self._add(m, expr.value)
            elif expr.value is not None:
                self.found.unfollowed.append(where)
        elif isinstance(expr, ast.JoinedStr):
            regex = "".join(
                re.escape(str(v.value)) if isinstance(v, ast.Constant) else r"[A-Za-z_:-]+"
                for v in expr.values
            )
            self.found.patterns[regex] = ast.unparse(expr)
        elif isinstance(expr, ast.IfExp):
            self._follow(m, expr.body, fn, depth + 1)
            self._follow(m, expr.orelse, fn, depth + 1)
        elif isinstance(expr, ast.BoolOp):
            for v in expr.values:
                self._follow(m, v, fn, depth + 1)
        elif isinstance(expr, ast.Name):
            self._follow_name(m, expr, fn, depth, where)
        elif isinstance(expr, ast.Attribute) and expr.attr in ("rule", "code"):
            pass  # an error's own rule (or code, collected below), passed on
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr == "get" and isinstance(expr.func.value, ast.Name):
                self._follow(m, expr.func.value, fn, depth + 1)
                for default in expr.args[1:]:
                    self._follow(m, default, fn, depth + 1)
            else:
                self.found.unfollowed.append(where)
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            defs = self.functions.get(expr.func.id, [])
            if not defs:
                self.found.unfollowed.append(where)
            for fm, callee in defs:
                for ret in ast.walk(callee):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        self._follow(fm, ret.value, callee, depth + 1)
        elif isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
            self._follow(m, expr.value, fn, depth + 1)
        elif isinstance(expr, ast.Dict):
            for v in expr.values:
                self._follow(m, v, fn, depth + 1)
        else:
            self.found.unfollowed.append(where)

    def _follow_name(
        self, m: _Module, expr: ast.Name, fn: Function | None, depth: int, where: str
    ) -> None:
        if fn is not None:
            params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            if any(a.arg == expr.id for a in params):
                return  # a parameter: its callers' values are rule slots of their own
            local = [
                n.value
                for n in ast.walk(fn)
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)
            ]
            if local:
                for value in local:
                    self._follow(m, value, fn, depth + 1)
                return
        if expr.id in self.globals:
            for value in self.globals[expr.id]:
                self._follow(m, value, fn, depth + 1)
        else:
            self.found.unfollowed.append(where)

    # --------------------------------------------------------------- the scan

    def _rule_positions(self) -> dict[str, int]:
        """Functions taking a ``rule`` parameter: its position, as callers pass it."""
        positions: dict[str, int] = {}
        for name, defs in self.functions.items():
            for _, fn in defs:
                args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                if "rule" in args:
                    index = args.index("rule") - (1 if args[0] in ("self", "cls") else 0)
                    positions[name] = index
        return positions

    def run(self) -> Found:
        errors = self._errors()
        positions = self._rule_positions()
        for name, values in self.globals.items():
            if name.endswith("_RULE"):  # a rule named once, used in texts (flow.unrecoverable)
                for value in values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        self.found.rules.setdefault(value.value, set())
        for m in self.modules:
            for node, fn in _walk(m.tree):
                if isinstance(node, ast.Call):
                    self._call(m, node, fn, errors, positions)
                elif isinstance(node, ast.Dict):
                    for key, value in zip(node.keys, node.values, strict=True):
                        # (not the OpenAPI schema's ``"rule": {"type": "string"}``)
                        if isinstance(key, ast.Constant) and key.value == "rule":
                            if not isinstance(value, ast.Dict):
                                self._follow(m, value, fn)
                elif isinstance(node, Function):
                    args = node.args
                    pos = args.posonlyargs + args.args
                    with_defaults = pos[len(pos) - len(args.defaults) :]
                    for arg, default in zip(with_defaults, args.defaults, strict=True):
                        if arg.arg == "rule":
                            self._follow(m, default, fn)
                    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                        if arg.arg == "rule" and kw_default is not None:
                            self._follow(m, kw_default, fn)
        return self.found

    def _call(
        self,
        m: _Module,
        node: ast.Call,
        fn: Function | None,
        errors: dict[str, str],
        positions: dict[str, int],
    ) -> None:
        name = (
            node.func.id
            if isinstance(node.func, ast.Name)
            else node.func.attr
            if isinstance(node.func, ast.Attribute)
            else ""
        )
        ruled = False
        for kw in node.keywords:
            if kw.arg == "rule":
                ruled = True
                self._follow(m, kw.value, fn)
        if name in positions and len(node.args) > positions[name]:
            ruled = True
            self._follow(m, node.args[positions[name]], fn)
        if name in errors and not ruled and name != "LeadgateError":
            self._add(m, errors[name])  # raised without a rule: its code is the rule


@cache
def _scan() -> _RuleScan:
    return _RuleScan()


@cache
def scanned() -> Found:
    """The rules of the product (see the module docstring)."""
    return _scan().run()


@cache
def _config_keys() -> set[str]:
    """``section.key`` for every key of every section (``models.provider`` too)."""
    return {
        f"{section}.{key}" for section, model in _sections().items() for key in model.model_fields
    }


@cache
def _columns() -> set[str]:
    """``table.column`` for every column of the schema."""
    return {f"{t.name}.{c.name}" for t in schema.metadata.tables.values() for c in t.columns}


def _not_a_rule(name: str) -> bool:
    first, *_, last = name.split(".")
    return (
        name in NOT_RULES
        or first in (*PACKAGES, "review", "importlib", "asyncio")  # Python modules
        or last in ("py", "toml", "md", "json", "js", "css", "svg", "db")  # files
        or name in _config_keys()
        or name in _columns()
    )


def test_the_scan_follows_every_rule_value() -> None:
    assert scanned().unfollowed == []


def _rules_table() -> set[str]:
    """The rules named in the first column of the README's Rules table."""
    section = readme().split("\n#### Rules\n", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row)}


def test_every_rule_is_in_the_rules_table() -> None:
    rules = scanned().rules
    missing = {rule: sorted(rules[rule]) for rule in sorted(set(rules) - _rules_table())}
    assert missing == {}, f"rules the README's Rules table leaves out (and where): {missing}"


def test_every_rule_pattern_has_an_example_in_the_rules_table() -> None:
    """An f-string rule (``{name}.range``) is named by at least one of its values."""
    missing = [
        form
        for regex, form in scanned().patterns.items()
        if not any(re.fullmatch(regex, name) for name in _rules_table())
    ]
    assert missing == [], f"rule patterns the Rules table gives no example of: {missing}"


def test_every_rule_of_the_rules_table_exists() -> None:
    found = scanned()
    unknown = sorted(
        name
        for name in _rules_table()
        if name not in found.rules and not any(re.fullmatch(p, name) for p in found.patterns)
    )
    assert unknown == [], f"the Rules table names rules the code does not have: {unknown}"


def test_every_rule_the_readme_names_exists() -> None:
    found = scanned()
    unknown = sorted(
        {
            name
            for name in DOTTED.findall(readme())
            if not _not_a_rule(name)
            and name not in found.rules
            and not any(re.fullmatch(p, name) for p in found.patterns)
        }
    )
    assert unknown == [], f"the README names rules the code does not have: {unknown}"


# ------------------------------------------------------------------ CLI


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command (``("org", "create")``) and its parser, groups included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options a command takes (``--help``, ``--config`` and ``--format``, which
    every command takes, left out)."""
    return {
        s
        for action in parser._actions
        for s in action.option_strings
        if s.startswith("--") and s not in ("--help", "--config", "--format")
    }


def _paragraphs() -> list[str]:
    return re.split(r"\n\s*\n", readme())


def _said(command: tuple[str, ...], text: str) -> bool:
    return re.search(rf"\bleadgate(?: --\S+(?: \S+)?)* {' '.join(command)}\b", text) is not None


def test_every_command_and_option_is_in_the_readme() -> None:
    """Each command is shown as ``leadgate <command>``; each of its options is in a
    paragraph (or code block) that shows the command."""
    missing = []
    for command, parser in _commands(build_parser()):
        if not command:
            continue
        where = [p for p in _paragraphs() if _said(command, p)]
        if not where:
            missing.append(" ".join(command))
        missing += [
            f"{' '.join(command)} {option}"
            for option in sorted(_options(parser))
            if not any(re.search(rf"{option}(?![\w-])", p) for p in where)
        ]
    assert missing == [], f"commands and options the README does not show: {missing}"


def _shown_lines() -> list[str]:
    """Every ``leadgate ...`` line of the README's code blocks, continuation lines joined."""
    shown = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", readme(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("leadgate "):
                shown.append(line)
    return shown


#: A metavariable of the README's command lines (``ORG``, ``N``).
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def _optional(group: re.Match[str]) -> str:
    # ``[--x V]`` is taken, ``[--a | --b]`` as its first choice; ``[same options]`` is prose.
    inside = group[1].strip()
    return f" {inside.split(' | ')[0]} " if inside.startswith("-") else " "


def _as_arguments(line: str) -> list[str]:
    """A shown command as arguments: comments dropped, optional parts taken, ``a|b`` as
    its first choice, ``...`` and what follows a shell operator left out."""
    while (taken := re.sub(r"\[([^\[\]]*)\]", _optional, line)) != line:
        line = taken  # inner groups first: ``[--key-file F [--rotate-key]]``
    words = shlex.split(line, comments=True)
    args = []
    for word in words[1:]:
        if word in ("|", "&&", ";") or word.startswith((">", "<", "2>")):
            break
        if word != "...":
            args.append(word.split("|")[0])
    return args


class _AnyPlaceholder(list[str]):
    """An option's choices that also take a metavariable."""

    def __contains__(self, value: object) -> bool:
        return (isinstance(value, str) and PLACEHOLDER.fullmatch(value) is not None) or (
            super().__contains__(value)
        )


def _placeholder_parser() -> argparse.ArgumentParser:
    """The CLI's parser, whose typed and limited options also take a metavariable."""
    parser = build_parser()
    for _, command in _commands(parser):
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if action.choices is not None:
                action.choices = _AnyPlaceholder(action.choices)
            if callable(action.type):
                typed = action.type

                def loose(value: str, typed: Callable[[str], object] = typed) -> object:
                    return value if PLACEHOLDER.fullmatch(value) else typed(value)

                action.type = loose
    return parser


@pytest.mark.parametrize("line", _shown_lines())
def test_every_command_line_the_readme_shows_parses(
    line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        _placeholder_parser().parse_args(_as_arguments(line))
    except SystemExit as exit_:
        assert exit_.code == 0, capsys.readouterr().err


def test_every_command_the_readme_names_in_text_exists() -> None:
    """```leadgate <command> [--option]``` in the text: the command exists and takes
    the options named."""
    parser = build_parser()
    commands = dict(_commands(parser))
    alone = _options(parser)  # ``leadgate --version``
    wrong = []
    for shown in re.findall(r"`(leadgate [^`]+)`", readme()):
        if shown.startswith("leadgate ..."):
            continue  # any command
        words = _as_arguments(shown)
        while words[:1] in (["--config"], ["--format"]):
            del words[:2]
        if not words and "..." in shown.split():
            continue  # ``leadgate --config FILE ...``: any command
        if len(words) == 1 and words[0] in alone:
            continue
        path: tuple[str, ...] = ()
        while words and (*path, words[0]) in commands:
            path = (*path, words.pop(0))
        options = {w.split("=")[0] for w in words if w.startswith("--")}
        unknown = options - _options(commands[path]) - {"--help", "--config", "--format"}
        if not path or unknown:
            wrong.append(shown)
    assert wrong == [], f"the README names commands or options the CLI does not take: {wrong}"


# ------------------------------------------------------------------ configuration


def _sections() -> dict[str, type[BaseModel]]:
    """Each section of the file and its model (``models``: each ``[models.NAME]``)."""
    sections: dict[str, type[BaseModel]] = {"models": ModelSettings}
    for name, info in Settings.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            sections[name] = info.annotation
    return sections


def _example_keys() -> dict[str, dict[str, str]]:
    """``config.example.toml``'s keys, those in comments (``# url = ...``) too, by
    section, each with its line and the comment lines after it."""
    keys: dict[str, dict[str, str]] = {}
    section = ""
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        text = line.lstrip("# ").rstrip()
        if heading := re.fullmatch(r"\[([a-z_]+)(?:\.[a-z_]+)?\]\s*(?:#.*)?", text):
            section = heading[1]
        elif key := re.match(r"([a-z_]+) = ", text):
            after = list(itertools.takewhile(lambda n: re.match(r"\s+#", n), lines[i + 1 :]))
            keys.setdefault(section, {})[key[1]] = "\n".join([line, *after])
    return keys


def test_every_setting_is_in_the_example_and_explained() -> None:
    """Each key is in ``config.example.toml`` (a commented-out line counts) with a comment
    on its line or the lines after it, or is named in the README."""
    example = _example_keys()
    missing = [
        f"[{section}] {key}"
        for section, model in _sections().items()
        for key in model.model_fields
        if key not in example.get(section, {})
    ]
    unexplained = [
        f"[{section}] {key}"
        for section, model in _sections().items()
        for key in model.model_fields
        if key in example.get(section, {})
        and "#" not in example[section][key].split("\n")[0].lstrip("# ")
        and len(example[section][key].split("\n")) == 1
        and not mentioned(key)
    ]
    assert (missing, unexplained) == ([], [])


def test_every_key_of_the_example_is_a_setting(tmp_path: Path) -> None:
    """The example loads, and each of its keys, those in comments too, is a setting."""
    load_settings(EXAMPLE, environ={})
    sections = _sections()
    unknown = [
        f"[{section}] {key}"
        for section, keys in _example_keys().items()
        for key in keys
        if section not in sections or key not in sections[section].model_fields
    ]
    assert unknown == []


def test_every_setting_the_readme_names_exists() -> None:
    """``[section] key`` in the README names a setting."""
    sections = _sections()
    unknown = sorted(
        {
            f"[{section}] {key}"
            for section, key in re.findall(r"\[([a-z_]+)\] ([a-z_]+)\b", readme())
            if section in sections and key not in sections[section].model_fields
        }
    )
    assert unknown == []


# ------------------------------------------------------------------ metrics


def _metrics() -> set[str]:
    """Every metric's name as ``/metrics`` shows it (a counter's with ``_total``)."""
    return {
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in Metrics().registry.collect()
    }


def _notify_channels() -> set[str]:
    """PostgreSQL NOTIFY channels (``leadgate_reviews``...): names like a metric's."""
    return {
        value.value
        for name, values in _scan().globals.items()
        if name.endswith("CHANNEL")
        for value in values
        if isinstance(value, ast.Constant) and isinstance(value.value, str)
    }


def test_every_metric_is_in_the_readme() -> None:
    missing = sorted(m for m in _metrics() if not mentioned(m))
    assert missing == [], f"metrics the README does not name: {missing}"


def test_every_metric_the_readme_names_exists() -> None:
    named = set(re.findall(r"\b(leadgate_[a-z_]+)", readme()))
    unknown = sorted(named - _metrics() - _notify_channels() - {"leadgate_session"})
    assert unknown == [], f"the README names metrics that do not exist: {unknown}"


# ------------------------------------------------------------------ routes


def _route_paths(tmp_path: Path) -> set[str]:
    """The path of every route of the served app, the channel webhooks mounted (built,
    never served or started)."""
    from nacl.signing import SigningKey

    from leadgate.app import App
    from tests.serving import webhook_channels

    url = f"sqlite+aiosqlite:///{tmp_path}/readme.db"
    channels = webhook_channels(SigningKey.generate())
    settings = Settings.model_validate({"database": {"url": url}, **channels})
    app = App(settings, clock=FakeClock(), enable_adapters=True).web_app()
    return {
        info.get("path") or info.get("formatter") or info.get("prefix", "")
        for route in app.router.routes()
        if route.resource is not None
        for info in [route.resource.get_info()]
    }


def test_every_route_is_in_the_readme(tmp_path: Path) -> None:
    """Each path is named, its ``{placeholders}`` as the README likes
    (``/operator/reviews/{id}/approve``, ``/v1/agents/AGENT_ID``)."""
    text = readme()
    missing = sorted(
        path
        for path in _route_paths(tmp_path)
        if not re.search(
            "".join(
                r"[^\s`/]+" if part.startswith("{") else re.escape(part)
                for part in re.split(r"(\{[^}]+\})", path)
            )
            + r"/?(?![\w/-])",
            text,
        )
    )
    assert missing == [], f"routes the README does not name: {missing}"
