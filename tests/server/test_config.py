"""ServerConfig is resolved once from cli/settings.py Settings; every setting is a flag, an EXSPEC_* variable and a row
of docs/SERVER.md with its default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from exspec.cli.flags import FLAGS
from exspec.server.config import SETTINGS_FIELDS, ServerConfig, server_config
from exspec.cli.settings import Settings as ServeSettings

DOC = (Path(__file__).resolve().parents[2] / "docs" / "SERVER.md").read_text()


def test_defaults_agree_and_settings_carry_over(monkeypatch):
    settings = ServeSettings(_env_file=None)
    config = server_config(settings)
    assert config == ServerConfig(served_model_name=None)
    for name in SETTINGS_FIELDS:
        assert name in FLAGS, name  # a flag and an EXSPEC_* variable
        assert getattr(settings, name) == getattr(config, name), name
    monkeypatch.setenv("EXSPEC_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("EXSPEC_MAX_N", "3")
    config = server_config(ServeSettings(_env_file=None, keep_alive_timeout=2.5), served_model_name="x")
    assert (config.max_body_bytes, config.max_n, config.keep_alive_timeout, config.served_model_name) == (
        1234, 3, 2.5, "x")


def test_every_flag_is_documented_with_its_variable_and_default():
    for field in FLAGS:
        flag, env = "--" + field.replace("_", "-"), "EXSPEC_" + field.upper()
        row = next((line for line in DOC.splitlines() if line.startswith(f"| `{flag}")), None)
        assert row is not None, f"{flag} is not in docs/SERVER.md"
        assert f"`{env}`" in row
        default = ServeSettings.model_fields[field].default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert f"`{default:g}`" in row or f"`{default}`" in row, (row, default)


@pytest.mark.parametrize("field, value", [("max_n", 0), ("max_body_bytes", 2**63), ("keep_alive_timeout", 0),
                                          ("shutdown_timeout", -1), ("max_stop_token_ids", -1), ("max_logit_bias", -1)])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerConfig().max_n = 3


def test_the_scheduler_implements_the_protocol_the_server_uses():
    """Everything SchedulerProtocol names exists on AsyncScheduler (a rename on either side fails here)."""
    from exspec.scheduler import AsyncScheduler
    from exspec.server.scheduler_api import SchedulerProtocol

    members = {name for name in vars(SchedulerProtocol) if not name.startswith("_")}
    assert {"model_name", "max_model_len", "tokenizer", "vocab_size", "submit", "abort", "start", "shutdown",
            "is_alive", "is_accepting", "num_waiting", "num_running", "kv_slots_used_ratio",
            "kv_cache_usage_perc", "add_step_listener"} <= members
    missing = sorted(name for name in members if not hasattr(AsyncScheduler, name))
    assert not missing, missing
