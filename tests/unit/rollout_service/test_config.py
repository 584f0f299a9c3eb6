from pathlib import Path

import pytest
import yaml

from rollout_service.config import DEFAULT_MODEL_DIR, load_settings

DEPLOY = Path(__file__).parents[3] / "deploy"


def test_precedence_is_defaults_file_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("port: 6000\nmetrics_port: 6001\nscheduler:\n  max_inflight: 7\nengine:\n  urls: [http://a:1]\n")
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", "7001")
    settings = load_settings(config, port=None, host="0.0.0.0")
    assert settings.port == 6000  # file; the None override is ignored
    assert settings.metrics_port == 7001  # env beats file
    assert settings.host == "0.0.0.0"  # explicit override
    assert settings.scheduler.max_inflight == 7
    assert settings.engine.urls == ["http://a:1"] and settings.engine.managed is None


def test_no_urls_means_the_managed_tiny_model() -> None:
    settings = load_settings()
    assert settings.engine.managed is not None
    assert settings.engine.managed.model == str(DEFAULT_MODEL_DIR)


def test_missing_file_and_unknown_keys_are_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_inflight: 3\n")  # belongs under scheduler:
    with pytest.raises(ValueError, match="max_inflight"):
        load_settings(bad)


@pytest.mark.parametrize(
    ("nested", "typo"),
    [
        ({"scheduler": {"max_inflght": 8}}, "max_inflght"),
        ({"engine": {"managed": {"blocksize": 16}}}, "blocksize"),
        ({"weight_sync": {"pause": "keep"}}, "pause"),
        ({"adapters": {"directory": "x"}}, "directory"),
    ],
)
def test_unknown_nested_keys_are_errors_that_name_them(nested: dict, typo: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=typo):
        load_settings(**nested)
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(nested))
    with pytest.raises(ValueError, match=typo):
        load_settings(config)


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    load_settings(path)


def test_the_default_pause_mode_follows_the_backend() -> None:
    """No pause on gloo, whose engine applies at finish; keep on nccl, whose engine moves the
    model's layers to the meta device from start_weight_update to finish."""
    assert load_settings().weight_sync.default_pause_mode() == "none"
    assert load_settings(weight_sync={"backend": "nccl"}).weight_sync.default_pause_mode() == "keep"
    chosen = load_settings(weight_sync={"backend": "nccl", "pause_mode": "abort"})
    assert chosen.weight_sync.default_pause_mode() == "abort"
    with pytest.raises(ValueError, match=r"pause mode none needs .* use keep, abort or wait"):
        load_settings(weight_sync={"backend": "nccl", "pause_mode": "none"})
