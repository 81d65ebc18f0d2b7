import pytest

from core.config import EngineConfig, PolicyConfig, SamplingParams, build, override
from core.errors import ConfigError


def test_precedence_flag_over_env_over_default():
    env = {"SPECGATE_MASS": "0.9", "SPECGATE_LOOKAHEAD": "3"}
    cfg = build(PolicyConfig, {"mass": 0.7, "lookahead": None}, env)
    assert cfg.mass == 0.7 and cfg.lookahead == 3 and cfg.chunk_size == 32


def test_env_parsing_and_errors():
    cfg = build(PolicyConfig, {}, {"SPECGATE_BREAK_EVEN": "off", "SPECGATE_GUARD_KEYWORDS": "a_,b_"})
    assert cfg.break_even is False and cfg.guard_keywords == ("a_", "b_")
    with pytest.raises(ConfigError, match="SPECGATE_MASS"):
        build(PolicyConfig, {}, {"SPECGATE_MASS": "lots"})


@pytest.mark.parametrize("kwargs", [
    {"mass": 0.0}, {"mass": 1.5}, {"select_mode": "best"}, {"position_mode": "shifted"},
    {"chunk_size": 0}, {"keep_fraction": 0}, {"guard_mode": "ignore"}, {"lookahead": -1},
])
def test_policy_validation(kwargs):
    with pytest.raises(ConfigError):
        PolicyConfig(**kwargs)


def test_sampling_and_engine_validation():
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="n_ubatch"):
        EngineConfig(n_batch=64, n_ubatch=128)
    assert EngineConfig(n_ctx=1024).speculator_n_ctx == 1024


def test_override_validates():
    base = PolicyConfig()
    assert override(base, mass=None) is base
    assert override(base, mass=0.5).mass == 0.5
    with pytest.raises(ConfigError):
        override(base, mass=2.0)
