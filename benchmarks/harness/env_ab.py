"""``--env-ab VAR=V1,V2``: one process times the same cases under several values of an environment variable."""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable
from typing import Any


class _DeprecatedAlias(argparse.Action):
    """``--ab-env``, bench_prefill's old spelling: stores into ``env_ab`` and warns."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        warnings.warn("--ab-env is deprecated: use --env-ab", FutureWarning, stacklevel=2)
        setattr(ns, self.dest, values)


def add_env_ab_argument(ap: argparse.ArgumentParser, help: str, metavar: str = "VAR=V1,V2") -> None:
    """``--env-ab`` (and its deprecated alias ``--ab-env``) into ``args.env_ab``."""
    ap.add_argument("--env-ab", dest="env_ab", default=None, metavar=metavar, help=help)
    ap.add_argument("--ab-env", dest="env_ab", action=_DeprecatedAlias, help=argparse.SUPPRESS)


def parse_env_ab(spec: str) -> tuple[str, list[str]]:
    """``"VAR=V1,V2"`` -> ``("VAR", ["V1", "V2"])``; a malformed spec exits with a message."""
    var, sep, vals = spec.partition("=")
    values = [v for v in vals.split(",") if v]
    if not sep or not var or not values:
        raise SystemExit(f"--env-ab: expected VAR=V1,V2, got {spec!r}")
    return var, values


def env_ab(spec: str | None) -> tuple[list[str | None], Callable[[str | None], None]]:
    """The settings ``["VAR=V1", "VAR=V2"]`` of ``--env-ab VAR=V1,V2`` (``[None]`` without it) and a setter that
    applies one (``None`` restores the variable as it was). The backends read their variables per call, so a
    case's executor (and its captured graphs) runs wholly under its setting."""
    if not spec:
        return [None], lambda s: None
    var, values = parse_env_ab(spec)
    before = os.environ.get(var)

    def set_env(setting: str | None) -> None:
        value = before if setting is None else setting.partition("=")[2]
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value

    return [f"{var}={v}" for v in values], set_env
