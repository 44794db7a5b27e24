"""Settings: defaults, then the environment, then flags."""
from __future__ import annotations

import pytest
import torch

from shared.settings import Settings


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("BATCH", "32")
    monkeypatch.setenv("WAIT_MS", "9")
    monkeypatch.setenv("PORT", "9000")
    settings = Settings.parse(["--wait", "7", "--model", "/models/x"], ["model", "batch", "wait_ms"], "test")
    assert (settings.batch, settings.wait_ms, settings.model) == (32, 7.0, "/models/x")
    assert settings.port == 9000  # from the environment, though not a flag of this program
    assert settings.redis_url == Settings().redis_url


def test_a_bad_value_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("PORT", "eighty")
    with pytest.raises(SystemExit, match="PORT='eighty'"):
        Settings.from_env()


def test_a_bad_flag_value_is_refused(capsys):
    with pytest.raises(SystemExit):
        Settings.parse(["--batch", "many"], ["batch"], "test")
    assert "--batch" in capsys.readouterr().err


def test_the_engine_takes_its_settings_once_as_an_engine_config():
    """worker/continuous/config.py copies the engine's settings, never sets one (the defaults are
    Settings'); off the CPU the quantized kernels' rows are 0, as torch's products run there."""
    from dataclasses import fields

    from worker.continuous.config import EngineConfig
    settings = Settings(block_size=8, max_batch_tokens=96, scheduler="prefill-first", int4_rows=32)
    config = EngineConfig.from_settings(settings)
    assert all(getattr(config, f.name) == getattr(settings, f.name) for f in fields(EngineConfig))
    assert EngineConfig.from_settings(settings, cpu=False).int4_rows == 0


def test_the_kv_caches_dtype_follows_what_was_asked():
    """--kv-dtype auto: float16 only where --dtype auto made a CPU compute in float32 (no bf16
    arithmetic there); a pinned --dtype float32, a bf16 model or a GPU keep the model's dtype. A
    half cache beside anything but float32 steps is refused with the reason."""
    from types import SimpleNamespace

    from worker.continuous.config import EngineConfig
    from worker.continuous.engine import cache_dtype

    def resolved(device="cpu", computes=torch.float32, **settings):
        loaded = SimpleNamespace(device=torch.device(device), dtype=computes)
        return cache_dtype(EngineConfig.from_settings(Settings(**settings)), loaded)

    assert Settings().kv_dtype == "auto"
    assert resolved() == torch.float16
    assert resolved(dtype="float32") == torch.float32
    assert resolved(computes=torch.bfloat16) == torch.bfloat16
    assert resolved(device="meta") == torch.float32
    assert resolved(kv_dtype="model") == torch.float32
    assert resolved(kv_dtype="bfloat16", dtype="float32") == torch.bfloat16
    with pytest.raises(ValueError, match="beside float32 steps only"):
        resolved(computes=torch.bfloat16, kv_dtype="float16")
    with pytest.raises(ValueError, match="expected one of auto, model, float16, bfloat16"):
        resolved(kv_dtype="int8")
