"""rollout.multi_turn: the config section, its rules, verl's keys, and the settings the generator reads."""
import pytest

from portagrpo.config import ConfigError, load_config
from portagrpo.errors import UserError
from portagrpo.rollout.generators import generator_spec
from portagrpo.rollout.generators.conversation import MultiTurnSettings
from portagrpo.train.experience import ExperienceSettings
from portagrpo.train.pipeline import RolloutSettings

AR = "actor_rollout_ref.rollout.multi_turn."
CALCULATOR = "tools:\n  - class_name: calculator\n    tool_schema: {function: {name: calculator}}\n"


def _problems(overrides, check_files=False):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, check_files=check_files)
    return str(err.value)


def test_defaults_are_off_and_single_turn_settings_are_unchanged():
    cfg = load_config(None, [])
    assert not cfg.rollout.multi_turn.enable
    assert generator_spec(cfg).name == "text" and generator_spec(cfg).settings is None
    with pytest.raises(UserError, match="needs rollout.multi_turn.enable=true"):  # the conversation's own reading
        MultiTurnSettings.from_config(cfg)


def test_enabled_settings_reach_the_generator(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(CALCULATOR)
    cfg = load_config(None, ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}",
                             "rollout.multi_turn.max_assistant_turns=3"])
    spec = generator_spec(cfg)
    s = spec.settings
    assert spec.name == "conversation" and isinstance(s, MultiTurnSettings)
    assert s.max_assistant_turns == 3 and s.tool_config_path == str(tools)


@pytest.mark.parametrize("override, words", [
    ("rollout.multi_turn.max_assistant_turns=0", "max_assistant_turns=0 must be at least 1"),
    ("rollout.multi_turn.max_tool_response_length=0", "max_tool_response_length=0 must be at least 1"),
    ("rollout.multi_turn.format=json", "format='json' is unknown; use hermes"),
    ("rollout.multi_turn.tool_timeout_s=0", "tool_timeout_s=0.0 must be positive"),
])
def test_bad_values_are_one_sentence_each(override, words):
    assert words in _problems([override])


def test_enable_needs_a_tool_file_and_composes_with_one_step_off_and_dapo(tmp_path):
    text = _problems(["rollout.multi_turn.enable=true"])
    assert "needs rollout.multi_turn.tool_config_path" in text
    tools = tmp_path / "tools.yaml"
    tools.write_text(CALCULATOR)
    cfg = load_config(None, ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}",
                             "algorithm.filter_groups.enable=true", "rollout.mode=one_step_off"])
    s = ExperienceSettings.from_config(cfg, stale=True)  # DAPO's rounds, sampled as conversations, one step off
    assert generator_spec(cfg).name == "conversation" and RolloutSettings.from_config(cfg).group_filter == "acc"
    assert not s.on_policy
    text = _problems(["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tmp_path}/none.yaml"],
                     check_files=True)
    assert "none.yaml' does not exist" in text


def test_verl_multi_turn_keys_map_with_notices(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(CALCULATOR)
    notices = []
    cfg = load_config(None, [f"{AR}enable=True", f"{AR}max_assistant_turns=4", f"{AR}tool_config_path={tools}",
                             f"{AR}format=hermes", f"{AR}max_tool_response_length=64", f"{AR}max_user_turns=4"],
                      notices=notices)
    m = cfg.rollout.multi_turn
    assert (m.enable, m.max_assistant_turns, m.tool_config_path, m.format, m.max_tool_response_length) == (
        True, 4, str(tools), "hermes", 64)
    text = "\n".join(notices)
    assert f"verl key {AR}enable -> portagrpo rollout.multi_turn.enable" in text
    assert "counted in tokens here" in text
    assert f"{AR}max_user_turns=4: no effect here" in text
