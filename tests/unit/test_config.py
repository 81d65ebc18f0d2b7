import pytest

from core.config import EngineConfig, check_kv_type
from core.errors import ConfigError
from core.loader import build, override
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, Scorer, ScorerKind, Selection, TurnParams
from gateway.serve_config import ServeConfig


def test_precedence_flag_over_env_over_default():
    env = {"SPECGATE_MASS": "0.9", "SPECGATE_LOOKAHEAD": "3"}
    cfg = build(PrefillPolicy, {"mass": 0.7, "lookahead": None}, env)
    assert cfg.selection.mass == 0.7 and cfg.lookahead == 3 and cfg.selection.chunk_size == 32


def test_env_parsing_and_errors():
    cfg = build(PrefillPolicy, {}, {"SPECGATE_BREAK_EVEN": "off", "SPECGATE_GUARD_KEYWORDS": "a_,b_"})
    assert cfg.break_even is False and cfg.guard_keywords == ("a_", "b_")
    with pytest.raises(ConfigError, match="SPECGATE_MASS"):
        build(PrefillPolicy, {}, {"SPECGATE_MASS": "lots"})


@pytest.mark.parametrize("kwargs", [
    {"mass": 0.0}, {"mass": 1.5}, {"select_mode": "best"}, {"position_mode": "shifted"},
    {"chunk_size": 0}, {"keep_fraction": 0}, {"guard_mode": "ignore"}, {"lookahead": -1}, {"gamma": 0},
    {"specattn_p": 1.5},
])
def test_policy_validation(kwargs):
    with pytest.raises(ConfigError):
        override(TurnParams(), **kwargs)


def test_sampling_and_engine_validation():
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="n_ubatch"):
        EngineConfig(n_batch=64, n_ubatch=128)
    assert EngineConfig(n_ctx=1024).speculator_ctx_len == 1024
    assert EngineConfig(n_ctx=1024, speculator_n_ctx=512).speculator_ctx_len == 512


def test_override_validates():
    base = PrefillPolicy()
    assert override(base, mass=None) is base
    assert override(base, mass=0.5).selection.mass == 0.5
    with pytest.raises(ConfigError):
        override(base, mass=2.0)
    with pytest.raises(ConfigError, match="specattn"):
        override(base, specattn=True)  # a decoding field is not a prefill field


def test_nested_configs_build_from_flat_flags_and_env():
    cfg = build(ServeConfig, {"port": "9000", "keep_fraction": "0.4", "specattn": "yes"},
                {"SPECGATE_SELECT_MODE": "chunk", "SPECGATE_N_CTX": "2048"})
    assert cfg.gateway.port == 9000 and cfg.engine.n_ctx == 2048
    assert cfg.prefill.selection == Selection(select_mode="chunk", keep_fraction=0.4)
    assert cfg.decoding == DecodingPolicy(specattn=True) and cfg.decoding.mode == "specattn"
    turn = override(TurnParams(), enabled=False, max_keep=64, gamma=2, max_tokens=7)
    assert (turn.prefill.enabled, turn.prefill.selection.max_keep) == (False, 64)
    assert (turn.decoding.gamma, turn.sampling.max_tokens) == (2, 7)


def test_the_default_scorer_is_the_q4_0_copy_which_drafts():
    assert Scorer() == Scorer.parse(EngineConfig().scorer) == Scorer(ScorerKind.SPECULATOR_Q4_0)
    assert EngineConfig().scorer_drafts


@pytest.mark.parametrize(("text", "kind", "blocks", "drafts"), [
    ("speculator-full", ScorerKind.SPECULATOR_FULL, 0, True),
    ("speculator-q4_0", ScorerKind.SPECULATOR_Q4_0, 0, True),
    ("speculator-early:8", ScorerKind.SPECULATOR_EARLY, 8, False),
    ("target-early:14", ScorerKind.TARGET_EARLY, 14, False),
])
def test_scorer_names_parse(text, kind, blocks, drafts):
    s = Scorer.parse(text)
    assert (s.kind, s.blocks, s.drafts) == (kind, blocks, drafts)
    assert build(EngineConfig, {"scorer": text}).scorer_drafts is drafts


@pytest.mark.parametrize("text", ["speculator", "target-early", "target-early:0", "target-early:-3",
                                  "speculator-early:x", "draft-early:4", "speculator-full:2", "speculator-q4_0:2",
                                  "speculator-q8_0", ""])
def test_bad_scorer_names_are_refused_with_the_forms(text):
    with pytest.raises(ConfigError, match="speculator-full, speculator-q4_0, speculator-early:R or target-early:R"):
        EngineConfig(scorer=text)


def test_speculative_decoding_by_default_needs_the_whole_speculator():
    with pytest.raises(ConfigError, match="drafts with the whole speculator, but --scorer is target-early:9"):
        build(ServeConfig, {"scorer": "target-early:9", "speculative": True})
    assert build(ServeConfig, {"scorer": "target-early:9"}).engine.scorer == "target-early:9"
    assert build(ServeConfig, {"speculative": True}).decoding.speculative


def test_kv_type_is_checked_against_the_flash_attention_settings():
    assert build(EngineConfig, {}, {"SPECGATE_KV_TYPE": "q8_0"}).kv_type == "q8_0"
    with pytest.raises(ConfigError, match="kv_type"):
        EngineConfig(kv_type="q4_0")
    check_kv_type("f16", False, False)  # f16 runs with either setting
    check_kv_type("q8_0", True, True)
    with pytest.raises(ConfigError, match="--target-flash-attn on"):
        check_kv_type("q8_0", False, True)
    with pytest.raises(ConfigError, match="--attention-capture flash"):
        check_kv_type("q8_0", True, False)
