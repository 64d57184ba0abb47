"""The config schema: frozen, typed dataclasses; YAML files are instances of it.

`load_config(path, overrides)` merges a YAML file and `key=value` overrides (dotted paths),
applies the algorithm preset, checks types, and validates cross-field rules. Every problem
is one sentence naming the field and the fix; all problems are reported together.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .errors import UnknownNameError, UserError


class ConfigError(UserError, ValueError):
    """Invalid configuration. `problems` holds one sentence per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class TinyModelConfig:
    """Architecture of the built-in random-init policy (used when `model.path` is null)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters through peft; rank 0 trains the full model."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str] = None
    ref_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    dtype: Literal["fp32", "bf16", "fp64"] = "fp32"
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass(frozen=True)
class DataConfig:
    task: Optional[str] = "repeat"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_size: int = 4096
    val_size: int = 64
    train_batch_size: int = 16
    max_prompt_length: int = 32
    max_response_length: int = 10
    shuffle: bool = True


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    val_temperature: float = 0.0
    val_n: int = 1
    vllm_gpu_memory_utilization: float = 0.5
    vllm_weight_bucket_mb: int = 512
    vllm_max_model_len: Optional[int] = None


@dataclass(frozen=True)
class RewardConfig:
    function: str = "auto"
    max_error_frac: float = 0.0
    num_workers: int = 1
    timeout_s: float = 10.0


@dataclass(frozen=True)
class AlgorithmConfig:
    name: Literal["grpo", "drgrpo"] = "grpo"
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    reward_clip: Optional[float] = None
    reward_norm: Literal["none", "batch"] = "none"
    reward_shift: bool = False
    reward_scale: bool = False
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    whiten_advantages: bool = False
    advantage_clip: Optional[float] = None


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 5
    lr_schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 64
    micro_batch_size: int = 32
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0


@dataclass(frozen=True)
class KernelsConfig:
    logprob: str = "auto"


@dataclass(frozen=True)
class TrainerConfig:
    device: str = "auto"
    seed: int = 1
    total_steps: Optional[int] = 300
    total_epochs: int = 1
    save_freq: int = 100
    test_freq: int = 40
    max_ckpt_to_keep: int = 2
    output_dir: Optional[str] = None
    deterministic: bool = False
    num_threads: Optional[int] = None
    progress_bar: bool = True
    tensorboard: bool = True
    plot: bool = True
    record_rollouts: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    devices_per_node: int = 1
    parallel: Literal["auto", "fsdp2", "ddp"] = "auto"
    dist_timeout_s: float = 600.0


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def clip_low(self) -> float:
        a = self.actor
        return a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low

    @property
    def clip_high(self) -> float:
        a = self.actor
        return a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high

    @property
    def loss_scale_factor(self) -> float:
        a = self.actor
        return float(self.data.max_response_length if a.loss_scale_factor is None else a.loss_scale_factor)

    @property
    def rollout_batch_size(self) -> int:
        return self.data.train_batch_size * self.rollout.n


# Values the `algorithm.name` preset sets unless the user set them explicitly.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {},
    "drgrpo": {
        "algorithm": {"norm_adv_by_std_in_grpo": False},
        "actor": {"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": False},
    },
}


# ---------------------------------------------------------------- typed construction


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError with one sentence."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where) if len(inner) == 1 else value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError([f"{where}={value!r} is not allowed{hint}; use one of {', '.join(map(repr, choices))}."])
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value] if not isinstance(value, str) else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError([f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}."])
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise ConfigError([f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}."])


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{prefix or 'the config'} must be a mapping of keys, got {type(raw).__name__} {raw!r}."])
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            problems.append(_unknown_key(where, str(key), names, prefix))
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], where)
        except ConfigError as err:
            problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return cls(**kwargs)


def _all_keys(cls: type = None, prefix: str = "") -> list[str]:
    cls = cls or Config
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_all_keys(hints[f.name], path))
        else:
            out.append(path)
    return out


def _unknown_key(where: str, key: str, names: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if not close:  # maybe it belongs to another section
        leaf_matches = [k for k in _all_keys() if k.rsplit(".", 1)[-1] == key]
        close = leaf_matches[:1]
        if close:
            return f"{where} is not a config key; did you mean {close[0]}?"
        close = difflib.get_close_matches(where, _all_keys(), n=1, cutoff=0.6)
        if close:
            return f"{where} is not a config key; did you mean {close[0]}?"
        return f"{where} is not a config key; see docs/config.md for the valid keys."
    full = f"{prefix}.{close[0]}" if prefix else close[0]
    return f"{where} is not a config key; did you mean {full}?"


# ---------------------------------------------------------------- merging


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError([f"override {item!r} must look like key=value (for example actor.lr=1e-3)."])
    key, text = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError([f"override {item!r} has an empty key; write key=value."])
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key.split("."), value


def set_dotted(raw: dict, path: list[str], value: Any) -> None:
    node = raw
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:
    from .config_rules import UniqueKeyLoader

    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"--config {str(path)!r} does not exist; pass the path of a YAML file (see configs/)."])
    try:
        data = yaml.load(p.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError([f"--config {str(path)!r} is not valid YAML ({err}); fix the file."]) from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {str(path)!r} must hold a mapping of sections, not a {type(data).__name__}."])
    return data


def merge_raw(config_path: str | Path | None, overrides: list[str] | None, notices: list[str] | None = None) -> dict:
    from .verl_compat import translate

    raw: dict = read_yaml(config_path) if config_path else {}
    pairs = []
    for item in overrides or []:
        path, value = parse_override(item)
        pairs.append((".".join(path), value))
    pairs, verl_notices, rejected = translate(pairs)
    if rejected:
        raise ConfigError([f"verl key {k} has no portagrpo equivalent; remove it (docs/config.md lists the verl keys "
                           f"portagrpo accepts)." for k in rejected])
    if notices is not None:
        notices.extend(verl_notices)
    mini_prompts = None
    for key, value in pairs:
        if key == "__verl_mini_batch_prompts":
            mini_prompts = value
            continue
        set_dotted(raw, key.split("."), value)
    explicit = {k for k, _ in pairs}
    # Giving files means training on them; giving epochs means counting steps by epochs.
    if "data.train_files" in explicit and "data.task" not in explicit:
        set_dotted(raw, ["data", "task"], None)
    if "trainer.total_epochs" in explicit and "trainer.total_steps" not in explicit:
        set_dotted(raw, ["trainer", "total_steps"], None)
    if mini_prompts is not None:
        n = (raw.get("rollout") or {}).get("n", RolloutConfig.n)
        try:
            set_dotted(raw, ["actor", "ppo_mini_batch_size"], int(mini_prompts) * int(n))
        except (TypeError, ValueError):
            raise ConfigError([f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_prompts!r} and rollout.n={n!r} "
                               f"must be integers."]) from None
    name = (raw.get("algorithm") or {}).get("name", "grpo") if isinstance(raw.get("algorithm"), dict) else "grpo"
    for section, values in PRESETS.get(name, {}).items():
        sec = raw.setdefault(section, {})
        if isinstance(sec, dict):
            for key, value in values.items():
                sec.setdefault(key, value)
    return raw


def load_config(
    config_path: str | Path | None = None, overrides: list[str] | None = None, *, check_files: bool = True,
    notices: list[str] | None = None,
) -> Config:
    """`notices` collects one line per verl key that was mapped onto a portagrpo key."""
    cfg = _build(Config, merge_raw(config_path, overrides, notices), "")
    problems = validate(cfg, check_files=check_files)
    if problems:
        raise ConfigError(problems)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """Return a copy of `cfg` with some keys of some sections replaced (programmatic overrides)."""
    updates = {}
    for section, values in sections.items():
        updates[section] = dataclasses.replace(getattr(cfg, section), **values)
    return dataclasses.replace(cfg, **updates)


# ---------------------------------------------------------------- validation


def validate(cfg: Config, *, check_files: bool = True) -> list[str]:
    """Cross-field rules. Returns one sentence per problem (empty when valid)."""
    from .algo import AGG_MODES, ADV_ESTIMATORS
    from .algo.losses import parse_kl_type
    from .config_rules import value_problems

    p: list[str] = []
    a, d, r, alg, t = cfg.actor, cfg.data, cfg.rollout, cfg.algorithm, cfg.trainer
    if alg.adv_estimator not in ADV_ESTIMATORS:
        p.append(f"algorithm.adv_estimator={alg.adv_estimator!r} is unknown; use one of {', '.join(ADV_ESTIMATORS)}.")
    if alg.adv_estimator == "grpo" and r.n < 2:
        p.append(f"rollout.n={r.n} gives groups of one, which carry no GRPO advantage; set rollout.n to 2 or more.")
    if a.loss_agg_mode not in AGG_MODES:
        close = difflib.get_close_matches(a.loss_agg_mode, AGG_MODES.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        p.append(f"actor.loss_agg_mode={a.loss_agg_mode!r} is unknown{hint}; use one of {', '.join(AGG_MODES)}.")
    try:
        parse_kl_type(a.kl_loss_type)
    except UnknownNameError as err:
        p.append(str(err))
    for name, value in (("data.train_batch_size", d.train_batch_size), ("rollout.n", r.n),
                        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                        ("actor.micro_batch_size", a.micro_batch_size), ("actor.ppo_epochs", a.ppo_epochs),
                        ("data.max_response_length", d.max_response_length),
                        ("data.max_prompt_length", d.max_prompt_length)):
        if value < 1:
            p.append(f"{name}={value} must be at least 1.")
    if p:
        return p
    total = cfg.rollout_batch_size
    if total % a.ppo_mini_batch_size:
        p.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} does not divide data.train_batch_size * rollout.n = "
            f"{d.train_batch_size} * {r.n} = {total} responses; pick a divisor of {total}."
        )
    if a.ppo_mini_batch_size % a.micro_batch_size:
        p.append(
            f"actor.micro_batch_size={a.micro_batch_size} does not divide actor.ppo_mini_batch_size="
            f"{a.ppo_mini_batch_size}; pick a divisor of {a.ppo_mini_batch_size}."
        )
    if a.clip_ratio_c <= 1.0:
        p.append(f"actor.clip_ratio_c={a.clip_ratio_c} must be greater than 1 (dual clip bound); the usual value is 3.0.")
    for name, value in (("actor.clip_ratio", a.clip_ratio), ("actor.clip_ratio_low", cfg.clip_low),
                        ("actor.clip_ratio_high", cfg.clip_high)):
        if value < 0:
            p.append(f"{name}={value} must be non-negative.")
    if cfg.clip_low >= 1:
        p.append(f"actor.clip_ratio_low={cfg.clip_low} must be below 1 so that 1 - clip_ratio_low stays positive.")
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        p.append(f"actor.loss_scale_factor={a.loss_scale_factor} must be positive (or null for the max response length).")
    if r.temperature <= 0:
        p.append(f"rollout.temperature={r.temperature} must be positive; use rollout.val_temperature=0 for greedy validation.")
    if not 0 < r.top_p <= 1:
        p.append(f"rollout.top_p={r.top_p} must be in (0, 1].")
    if cfg.reward.num_workers < 0 or cfg.reward.timeout_s <= 0:
        p.append(f"reward.num_workers={cfg.reward.num_workers} must be >= 0 and reward.timeout_s="
                 f"{cfg.reward.timeout_s} positive.")
    if not 0 <= cfg.reward.max_error_frac <= 1:
        p.append(f"reward.max_error_frac={cfg.reward.max_error_frac} must be between 0 and 1.")
    if alg.use_kl_in_reward and a.use_kl_loss:
        p.append("algorithm.use_kl_in_reward and actor.use_kl_loss are both true; docs/design.md uses one or the other, so set actor.use_kl_loss=false.")
    if t.total_steps is not None and t.total_steps < 1:
        p.append(f"trainer.total_steps={t.total_steps} must be at least 1 (or null to use trainer.total_epochs).")
    for name, value in (("trainer.save_freq", t.save_freq), ("trainer.test_freq", t.test_freq)):
        if value < 0:
            p.append(f"{name}={value} must be 0 (off) or positive.")
    lora = cfg.model.lora
    if lora.rank < 0:
        p.append(f"model.lora.rank={lora.rank} must be 0 (off) or positive.")
    if lora.rank > 0 and not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout={lora.dropout} must be in [0, 1).")
    if lora.rank > 0 and cfg.model.ref_path:
        p.append("model.ref_path is set but with LoRA the reference is the base model with adapters disabled "
                 "(no second copy); remove model.ref_path or set model.lora.rank=0.")
    if lora.rank > 0 and not lora.target_modules:
        p.append("model.lora.target_modules is empty; name the modules to adapt, e.g. [q_proj, v_proj].")
    if t.nproc_per_node < 1:
        p.append(f"trainer.nproc_per_node={t.nproc_per_node} must be at least 1.")
    if t.nnodes < 1 or t.devices_per_node < 1:
        p.append(f"trainer.nnodes={t.nnodes} and trainer.devices_per_node={t.devices_per_node} must be at least 1.")
    if t.dist_timeout_s <= 0:
        p.append(f"trainer.dist_timeout_s={t.dist_timeout_s} must be positive.")
    if t.max_ckpt_to_keep < 1:
        p.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be at least 1.")
    if not d.train_files and not d.task:
        p.append("data.train_files is empty and data.task is null; give a JSONL/Parquet file or a built-in task such as data.task=repeat.")
    if d.train_files and d.task:
        p.append(f"data.train_files and data.task={d.task!r} are both set; set data.task=null to train on the files.")
    p.extend(value_problems(cfg))
    if check_files:
        p.extend(_missing_files(cfg))
    return p


def validate_world(cfg: Config, world_size: int) -> list[str]:
    """Batch divisions that depend on the number of data-parallel ranks."""
    if world_size == 1:
        return []
    p = []
    d, a = cfg.data, cfg.actor
    if d.train_batch_size % world_size:
        p.append(f"data.train_batch_size={d.train_batch_size} prompts cannot be split over {world_size} ranks; "
                 f"use a multiple of {world_size} (each rank keeps whole groups).")
    if a.ppo_mini_batch_size % world_size:
        p.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} cannot be split over {world_size} ranks; "
                 f"use a multiple of {world_size}.")
    elif (a.ppo_mini_batch_size // world_size) % a.micro_batch_size:
        p.append(f"actor.micro_batch_size={a.micro_batch_size} does not divide the per-rank mini-batch "
                 f"{a.ppo_mini_batch_size} / {world_size} = {a.ppo_mini_batch_size // world_size}; pick a divisor of it.")
    return p


def _missing_files(cfg: Config) -> list[str]:
    p = []
    from .modeling import resolve_model_path

    for name in ("path", "ref_path", "tokenizer_path"):
        value = getattr(cfg.model, name)
        if not value:
            continue
        try:
            exists = resolve_model_path(value).exists()
        except FileNotFoundError as err:
            p.append(str(err))
            continue
        if not exists:
            p.append(f"model.{name}={value!r} does not exist; give a local Hugging Face model directory or a .gguf "
                     f"file (nothing is downloaded).")
    for name in ("train_files", "val_files"):
        for i, value in enumerate(getattr(cfg.data, name)):
            if not Path(value).is_file():
                p.append(f"data.{name}[{i}]={value!r} does not exist; give the path of a .jsonl or .parquet file.")
    fn = cfg.reward.function
    if ":" in fn and fn.split(":", 1)[0].endswith(".py") and not Path(fn.split(":", 1)[0]).is_file():
        p.append(f"reward.function={fn!r}: the file {fn.split(':', 1)[0]!r} does not exist; use path/to/file.py:function_name.")
    return p
