"""Typed settings for every process: one msgspec Struct, filled from flags and env.

Precedence: command-line flag > ``FAIRLANE_<FIELD>`` environment variable > default.
A field ``max_num_seqs`` is ``--max-num-seqs`` and ``FAIRLANE_MAX_NUM_SEQS``.

Strict, because a typo that silently falls back to a default is found only in
production: a malformed number or bool, a value outside a field's choices, a negative
duration (a field named ``*_ms`` or ``*_s``) or a ``FAIRLANE_*`` variable
that no fairlane process reads stops the process at start with ONE line naming the
flag or variable (exit 2, no traceback).

A field's ``--help`` sentence is its ``msgspec.Meta(description=...)`` if it has one,
else its trailing comment, else the comment block right above it: the comment a
reader of the config module sees is the help a user sees. `Literal` fields list their
choices.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import importlib.util
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import msgspec
import msgspec.inspect as mi

S = TypeVar("S", bound=msgspec.Struct)
# For counts and periods where 0 would mean a busy loop or nothing ever happening.
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

ENV_PREFIX = "FAIRLANE_"
# Where the fleet's settings Structs live. `fairlane up` and compose hand one
# environment to several processes (FAIRLANE_DTYPE is for workers, yet the dispatcher
# sees it too), so a variable is unknown only if NO process reads it. The modules are
# read as source, never imported: the kernel depends on no process package.
FLEET_SETTINGS_MODULES = (
    "fairlane.streams",
    "fairlane.natsconn",
    "fairlane.cli",
    "dispatcher.config",
    "gpu_worker.config",
    "streamer.config",
    "producer.config",
)
# Read by other tools, and so likely to be exported in the same shell.
NON_SETTINGS_ENV = frozenset({
    "FAIRLANE_SKIP_VLLM",  # scripts/test.sh
    "FAIRLANE_IMAGE", "FAIRLANE_GPU_IMAGE",  # compose/docker-compose.yml
})
_DURATION_SUFFIXES = ("_ms", "_s")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingsError(ValueError):
    """A bad setting; the message is one line naming the flag or variable."""


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: mi.Type  # the field's type, without Metadata
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def types(self) -> tuple[mi.Type, ...]:
        """The field's type, or each member of its union (``int | None``)."""
        return self.kind.types if isinstance(self.kind, mi.UnionType) else (self.kind,)

    def accepts(self, *kinds: type) -> bool:
        return any(isinstance(t, kinds) for t in self.types)

    @property
    def optional(self) -> bool:
        return self.accepts(mi.NoneType)

    @property
    def is_bool(self) -> bool:
        return self.accepts(mi.BoolType)

    @property
    def is_list(self) -> bool:
        return self.accepts(mi.ListType, mi.TupleType, mi.VarTupleType)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(str(v) for t in self.types if isinstance(t, mi.LiteralType)
                     for v in t.values)


# --- reading a settings Struct -------------------------------------------------------


@functools.cache
def _fields(cls: type[msgspec.Struct]) -> tuple[_Field, ...]:
    comments = _comment_help(cls)
    out = []
    for f in mi.type_info(cls).fields:
        kind, described = f.type, ""
        if isinstance(kind, mi.Metadata):
            described = (kind.extra_json_schema or {}).get("description", "")
            kind = kind.type
        default = f.default if f.default is not msgspec.NODEFAULT else None
        out.append(_Field(f.name, kind, default, described or comments.get(f.name, "")))
    return tuple(out)


def _comment_help(cls: type) -> dict[str, str]:
    """field -> its trailing comment, else the comment block above it (inherited too)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, msgspec.Struct)) or (
                klass is msgspec.Struct):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (frozen app): help without sentences
            continue
        lines = src.splitlines()
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                    if tok.type == tokenize.COMMENT}
        for stmt in ast.parse(src).body[0].body:  # type: ignore[attr-defined]
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            text = comments.get(stmt.end_lineno or stmt.lineno, "")
            if not text:
                block: list[str] = []
                i = stmt.lineno - 1  # 1-based line numbers: lines[i - 1] is the one above
                while i >= 1 and lines[i - 1].lstrip().startswith("#"):
                    block.insert(0, comments.get(i, ""))
                    i -= 1
                text = " ".join(block)
            out[stmt.target.id] = text
    return out


@functools.cache
def fleet_env_names() -> frozenset[str]:
    """Every FAIRLANE_* variable some fairlane process reads (see FLEET_SETTINGS_MODULES)."""
    names = set(NON_SETTINGS_ENV)
    for module in FLEET_SETTINGS_MODULES:
        try:
            spec = importlib.util.find_spec(module.rpartition(".")[0] or module)
            origin = Path(spec.origin).with_name(module.rpartition(".")[2] + ".py") if (
                spec and spec.origin) else None
        except (ImportError, ValueError):
            origin = None
        if origin is None or not origin.is_file():
            continue
        for node in ast.walk(ast.parse(origin.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
                names.update(ENV_PREFIX + s.target.id.upper() for s in node.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names)


# --- the parser ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """One error line (no usage dump: with 30 flags it would bury the message)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(cls: type[S], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description)
    own = set(vars(cls).get("__annotations__", {}))
    # The process's own settings first, then shared ones (e.g. stream settings).
    for f in sorted(_fields(cls), key=lambda f: f.name not in own):
        parts = [f.help[:1].upper() + f.help[1:].rstrip(".") + "." if f.help else ""]
        if f.choices:
            parts.append(f"One of: {'|'.join(f.choices)}.")
        if f.is_list:
            parts.append("Comma-separated.")
        shown = "" if f.default in (None, "") and not f.is_bool else f"; default {f.default!r}"
        parts.append(f"[env {f.env}{shown}]")
        help_text = " ".join(p for p in parts if p).replace("%", "%%")
        if f.is_bool:
            parser.add_argument(f.flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(f.flag, dest=f.name, default=None, help=help_text,
                                choices=f.choices or None, metavar=_metavar(f))
    return parser


def _metavar(f: _Field) -> str:
    if f.choices:
        return "{" + "|".join(f.choices) + "}"
    if f.is_list:
        return "A,B,..."
    if f.accepts(mi.IntType):
        return "N"
    if f.accepts(mi.FloatType):
        return "X"
    return "TEXT"


# --- values --------------------------------------------------------------------------


def _coerce(f: _Field, raw: str, source: str) -> Any:
    """A raw string (env var or flag) -> what msgspec converts, or SettingsError."""
    if f.optional and raw == "":
        return None
    if f.is_bool:
        v = raw.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise SettingsError(f"{source}={raw!r}: expected a bool (1|0, true|false, yes|no, on|off)")
    if f.is_list:
        return [x for x in (p.strip() for p in raw.split(",")) if x]
    return raw


_BOUND_RE = re.compile(r"Expected `\w+` (?P<op>[<>]=?) (?P<bound>\S+)")
_KIND_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a bool"}


def _explain(message: str, f: _Field | None) -> str:
    """msgspec's message, in a user's words."""
    message = re.sub(r" - at `\$[^`]*`$", "", message)
    if m := _BOUND_RE.match(message):
        return f"must be {m['op']} {m['bound']}"
    if m := re.match(r"Expected `(\w+)( \| null)?`", message):
        return "expected " + _KIND_WORDS.get(m[1], m[1])
    if message.startswith("Invalid enum value") and f is not None and f.choices:
        return "expected one of: " + "|".join(f.choices)
    return message[:1].lower() + message[1:]


def parse_settings(cls: type[S], argv: Sequence[str], env: Mapping[str, str],
                   parser: argparse.ArgumentParser | None = None) -> S:
    """Build ``cls`` from argv and env; SettingsError (one line) on any bad input.

    Unknown flags and invalid choices on the command line exit through `parser`."""
    parser = parser or build_parser(cls, cls.__name__)
    fields = {f.name: f for f in _fields(cls)}
    for key in sorted(env):
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() not in fields and (
                key not in fleet_env_names()):
            near = difflib.get_close_matches(key, sorted(fleet_env_names()), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise SettingsError(f"unknown environment variable {key} "
                                f"(no fairlane process reads it{hint})")
    ns = parser.parse_args(list(argv))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in fields.values():
        flag_val = getattr(ns, f.name, None)
        if flag_val is not None:
            sources[f.name] = f.flag
            values[f.name] = (_coerce(f, flag_val, f.flag) if isinstance(flag_val, str)
                              else flag_val)
        elif (raw := env.get(f.env)) is not None:
            sources[f.name] = f.env
            values[f.name] = _coerce(f, raw, f.env)
    try:
        settings = msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise _named(str(exc), fields, sources, values) from None
    for name in fields:
        v = getattr(settings, name)
        if (name.endswith(_DURATION_SUFFIXES) and isinstance(v, int | float)
                and not isinstance(v, bool) and v < 0):
            raise _named(f"Expected `float` >= 0 - at `$.{name}`", fields, sources, values)
    return settings


def _named(message: str, fields: dict[str, _Field], sources: dict[str, str],
           values: dict[str, Any]) -> SettingsError:
    m = re.search(r" - at `\$\.(\w+)", message)
    name = m[1] if m else next((n for n in fields if re.search(rf"\b{n}\b", message)), None)
    if name is None:
        return SettingsError(_explain(message, None))
    f = fields[name]
    where = sources.get(name, f"{f.flag} / {f.env}")
    shown = f"={values[name]!r}" if name in values else ""
    return SettingsError(f"{where}{shown}: {_explain(message, f)}")


def load_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str = "",
) -> S:
    """`parse_settings` for a process's `main()`: bad input prints one line, exits 2."""
    parser = build_parser(cls, prog or cls.__name__, description)
    try:
        return parse_settings(cls, sys.argv[1:] if argv is None else argv,
                              os.environ if env is None else env, parser)
    except SettingsError as exc:
        parser.error(str(exc))
