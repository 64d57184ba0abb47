"""The config: schema.py (the dataclasses), load.py (YAML + overrides -> Config), rules.py (what a
valid config satisfies), verl.py (verl's keys)."""
from portagrpo.config.bounds import correction_bounds
from portagrpo.config.load import (
    all_keys,
    from_dict,
    load_config,
    merge_raw,
    parse_override,
    read_yaml,
    replace,
    to_dict,
    to_yaml,
)
from portagrpo.config.rules import missing_files, strategy_problems, validate, validate_world
from portagrpo.config.schema import (
    PRESETS,
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    KernelsConfig,
    LoraSettings,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
)

__all__ = [
    "PRESETS", "ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "KernelsConfig",
    "LoraSettings", "ModelConfig", "RewardConfig", "RolloutConfig", "TinyModelConfig", "TrainerConfig",
    "all_keys", "correction_bounds", "from_dict", "load_config", "merge_raw", "missing_files", "parse_override",
    "read_yaml", "replace", "to_dict", "to_yaml", "strategy_problems", "validate", "validate_world",
]
