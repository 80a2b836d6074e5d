"""Strategies chosen by name (policies, cost models, engines): one lookup, one error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

F = TypeVar("F")


def choose(registry: Mapping[str, F], name: str, kind: str) -> F:
    """The factory registered under `name`; ValueError listing the choices otherwise."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}") from None
