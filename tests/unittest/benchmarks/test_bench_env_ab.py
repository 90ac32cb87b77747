"""`benchmarks.harness.env_ab`: ``--env-ab VAR=V1,V2`` and its deprecated spelling ``--ab-env``."""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks.harness.env_ab import add_env_ab_argument, env_ab

pytestmark = pytest.mark.cpu_only


def test_both_spellings_fill_env_ab_and_the_old_one_warns() -> None:
    ap = argparse.ArgumentParser()
    add_env_ab_argument(ap, "help")
    assert ap.parse_args(["--env-ab", "X=1,2"]).env_ab == "X=1,2"
    with pytest.warns(FutureWarning, match="--env-ab"):
        assert ap.parse_args(["--ab-env", "X=3"]).env_ab == "X=3"
    assert ap.parse_args([]).env_ab is None


def test_settings_apply_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_AB_TEST_VAR", "before")
    settings, set_env = env_ab("BENCH_AB_TEST_VAR=a,b")
    assert settings == ["BENCH_AB_TEST_VAR=a", "BENCH_AB_TEST_VAR=b"]
    set_env(settings[1])
    assert os.environ["BENCH_AB_TEST_VAR"] == "b"
    set_env(None)
    assert os.environ["BENCH_AB_TEST_VAR"] == "before"
    assert env_ab(None)[0] == [None]
    with pytest.raises(SystemExit):
        env_ab("NOVALUES=")
