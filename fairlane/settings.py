"""Typed settings for every process: one msgspec Struct, filled from flags and env.

Precedence: command-line flag > ``FAIRLANE_<FIELD>`` environment variable > default.
A field ``max_num_seqs`` is ``--max-num-seqs`` and ``FAIRLANE_MAX_NUM_SEQS``. Values are
converted and validated by msgspec, so a bad value fails at start with a clear message.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)

ENV_PREFIX = "FAIRLANE_"


class SettingsError(Exception):
    pass


def _is_bool(tp: Any) -> bool:
    if tp is bool:
        return True
    args = typing.get_args(tp)
    return bool(args) and bool in args and all(a in (bool, type(None)) for a in args)


def _is_list(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(tp))
    return False


def _coerce_env(tp: Any, raw: str) -> Any:
    if _is_bool(tp):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if _is_list(tp):
        return [x for x in (p.strip() for p in raw.split(",")) if x]
    return raw


def build_parser(cls: type[S], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = {f.name: f.default for f in msgspec.structs.fields(cls)}
    for name, tp in hints.items():
        if name.startswith("_"):
            continue
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        default = defaults.get(name)
        shown = "" if default is msgspec.NODEFAULT else f" (default: {default!r})"
        help_text = f"env {env}{shown}"
        if _is_bool(tp):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif _is_list(tp):
            parser.add_argument(flag, dest=name, default=None, help=help_text + "; comma-separated")
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    return parser


def load_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str = "",
) -> S:
    """Build ``cls`` from argv and env. Raises SystemExit(2) with a message on bad input."""
    env = os.environ if env is None else env
    parser = build_parser(cls, prog or cls.__name__, description)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    hints = typing.get_type_hints(cls, include_extras=True)
    values: dict[str, Any] = {}
    for name, tp in hints.items():
        env_raw = env.get(ENV_PREFIX + name.upper())
        if env_raw is not None:
            values[name] = _coerce_env(tp, env_raw)
        flag_val = getattr(ns, name, None)
        if flag_val is not None:
            values[name] = _coerce_env(tp, flag_val) if isinstance(flag_val, str) else flag_val
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        parser.error(f"invalid setting: {exc}")
        raise  # unreachable: parser.error exits
