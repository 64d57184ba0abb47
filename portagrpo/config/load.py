"""Loading a config: YAML (duplicate keys refused), dotted `key=value` overrides, verl keys, the
algorithm preset, typed construction with one sentence per wrong key or type, then the rules."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from portagrpo.config.bounds import NUMBER
from portagrpo.config.schema import PRESETS, Config, ConfigError, DataConfig, RolloutConfig
from portagrpo.fileio import UniqueKeyLoader, shorten

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
            raise ConfigError(
                [f"{where}={short(value)} is not allowed{hint}; use one of {', '.join(map(repr, choices))}."]
            )
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value] if not isinstance(value, str) else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError([f"{where} must be {_type_name(tp)}, got {type(value).__name__} {short(value)}."])
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp in (int, float):  # an int field takes ints only; a float field takes both
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and (tp is float or isinstance(value, int)):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value.written if isinstance(value, (SpelledInt, SpelledFloat)) else str(value)
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise ConfigError([f"{where} must be {_type_name(tp)}, got {type(value).__name__} {short(value)}."])


def from_dict(raw: dict[str, Any]) -> Config:
    """A Config from its `to_dict` form (a config that crossed a process boundary), checked as loading checks it."""
    return _build(Config, raw, "")


def _build(cls: type, raw: Any, prefix: str, problems: list[str] | None = None) -> Any:
    """`cls` from the mapping `raw`. With a `problems` list, every wrong key or type is appended
    there and left at its default, so the caller can go on to report every other problem too;
    without one, the first section with problems raises ConfigError."""
    collect = problems is not None
    problems = [] if problems is None else problems
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        message = f"{prefix or 'the config'} must be a mapping of keys, got {type(raw).__name__} {short(raw)}."
        if collect:
            problems.append(message)
            return cls()
        raise ConfigError([message])
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    before = len(problems)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            problems.append(_unknown_key(where, str(key), names, prefix))
            continue
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _build(hints[key], value, where, problems if collect else None)
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], where)
        except ConfigError as err:
            problems.extend(err.problems)
    if len(problems) > before and not collect:
        raise ConfigError(problems)
    return cls(**kwargs)


def short(value: Any) -> str:
    """`repr(value)`, cut (fileio.shorten): a bad value is named, never echoed whole."""
    return shorten(repr(value))


def all_keys(cls: type = None, prefix: str = "") -> list[str]:
    cls = cls or Config
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(all_keys(hints[f.name], path))
        else:
            out.append(path)
    return out


def _unknown_key(where: str, key: str, names: list[str], prefix: str) -> str:
    # the exact name in another section beats a near name in this one (trainer.lr -> actor.lr)
    leaf_matches = [k for k in all_keys() if k.rsplit(".", 1)[-1] == key]
    if leaf_matches:
        return f"{where} is not a config key; did you mean {leaf_matches[0]}?"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if not close:  # maybe it belongs to another section
        close = difflib.get_close_matches(where, all_keys(), n=1, cutoff=0.6)
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
    try:  # a SafeLoader that keeps how a number that is no plain decimal was written (see SpelledInt)
        value = yaml.load(text, Loader=ConfigLoader) if text.strip() else ""  # noqa: S506
    except (yaml.YAMLError, ValueError):  # ValueError: an integer longer than Python converts
        value = text
    return key.split("."), value


def set_dotted(raw: dict, path: list[str], value: Any) -> None:
    node = raw
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is not None and not isinstance(child, dict):  # never silently replace what the file says
            section = ".".join(path[:depth + 1])
            raise ConfigError([f"{section} is {short(child)} in the config, not a section of keys, so "
                               f"{'.'.join(path)} cannot be set inside it; make {section} a mapping (or remove it)."])
        if child is None:
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:

    p = Path(path)
    if p.is_dir():
        raise ConfigError([f"--config {str(path)!r} is a directory; pass the path of a YAML file (see configs/)."])
    if not p.is_file():
        raise ConfigError([f"--config {str(path)!r} does not exist; pass the path of a YAML file (see configs/)."])
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise ConfigError([f"--config {str(path)!r} is not a text file (not UTF-8); pass a YAML recipe."]) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"--config {str(path)!r} is not valid YAML ({err}); fix the file."]) from err
    except ValueError as err:  # e.g. an integer longer than Python converts
        raise ConfigError(
            [f"--config {str(path)!r} holds a value YAML cannot read ({str(err)[:100]}); fix the file."]
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config {str(path)!r} must hold a mapping of sections, not a {type(data).__name__}."])
    return data


def merge_raw(config_path: str | Path | None, overrides: list[str] | None, notices: list[str] | None = None,
              problems: list[str] | None = None) -> dict:
    """The raw mapping: the YAML file, then the overrides. With a `problems` list, a bad override
    is appended there and skipped, so every problem is reported at once; without one it raises."""
    from portagrpo.config.roll import is_roll
    from portagrpo.config.roll import translate as translate_roll
    from portagrpo.config.verl import expert_parallel_refusal, translate

    found: list[str] = []
    raw: dict = read_yaml(config_path) if config_path else {}
    pairs = []
    roll = is_roll(raw)
    if roll:  # a ROLL YAML as written: its keys become portagrpo overrides, before the real ones
        roll_pairs, roll_notices, roll_problems = translate_roll(raw)
        raw, found = {}, list(roll_problems)
        pairs += list(roll_pairs.items())
        if notices is not None:
            notices.extend(roll_notices)
    for item in overrides or []:
        try:
            path, value = parse_override(item)
        except ConfigError as err:
            found.extend(err.problems)
            continue
        pairs.append((".".join(path), value))
    pairs, verl_notices, rejected = translate(pairs)
    found += [expert_parallel_refusal(k) or f"verl key {k} has no portagrpo equivalent; remove it (docs/config.md "
              f"lists the verl keys portagrpo accepts)." for k in rejected]
    if notices is not None:
        notices.extend(verl_notices)
    mini_prompts = roll_mini = None
    for key, value in pairs:
        if key == "__verl_mini_batch_prompts":
            mini_prompts = value
            continue
        if key == "__roll_mini_batch_per_rank":
            roll_mini = value
            continue
        try:
            set_dotted(raw, key.split("."), value)
        except ConfigError as err:
            found.extend(p for p in err.problems if p not in found)
    if found and problems is None:
        raise ConfigError(found)
    if problems is not None:
        problems.extend(found)
    _derived(raw, {k for k, _ in pairs}, mini_prompts)
    if roll and mini_prompts is None and "actor.ppo_mini_batch_size" not in {k for k, _ in pairs}:
        _roll_mini_batch(raw, roll_mini, notices)
    return raw


def _roll_mini_batch(raw: dict, per_rank: Any, notices: list[str] | None) -> None:
    """ROLL's mini-batch in responses, unless an override set actor.ppo_mini_batch_size: per device x
    gradient accumulation x data-parallel ranks, or with no per_device_train_batch_size ROLL's own default,
    one update over the whole rollout batch."""
    def section(name: str) -> dict:
        return raw[name] if isinstance(raw.get(name), dict) else {}

    try:
        if per_rank is not None:
            size = int(per_rank) * int(section("trainer").get("nproc_per_node", 1))
        else:
            size = (int(section("data").get("train_batch_size", DataConfig.train_batch_size))
                    * int(section("rollout").get("n", RolloutConfig.n)))
        set_dotted(raw, ["actor", "ppo_mini_batch_size"], size)
    except (TypeError, ValueError):  # ConfigError too: a size that is no number, or `actor` no section,
        return  # which the typed construction names
    if per_rank is None and notices is not None:
        notices.append(f"ROLL sets no actor_train.training_args.per_device_train_batch_size -> portagrpo "
                       f"actor.ppo_mini_batch_size={size}, the whole rollout batch (one update per step, ROLL's "
                       f"default)")


def _derived(raw: dict, explicit: set[str], mini_prompts: Any) -> None:
    """Values that follow from what was given: files mean no built-in task, epochs mean no step count,
    verl's mini-batch count in responses, and the algorithm preset's defaults."""
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


def load_config(
    config_path: str | Path | None = None, overrides: list[str] | None = None, *, check_files: bool = True,
    notices: list[str] | None = None,
) -> Config:
    """`notices` collects one line per verl key that was mapped onto a portagrpo key."""
    from portagrpo.config.rules import validate

    problems: list[str] = []
    cfg = _build(Config, merge_raw(config_path, overrides, notices, problems), "", problems)
    # every problem at once: wrong keys and types (left at their defaults) and then the rules
    problems += [p for p in validate(cfg, check_files=check_files) if p not in problems]
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


class ConfigLoader(UniqueKeyLoader):
    """A config's YAML: a key given twice refused, numbers spelled other than as plain decimals kept as written."""


class SpelledInt(int):
    """A number YAML read from text that is no plain decimal (YAML 1.1 drops "_" as a digit separator, so 1_2 is
    12 and 0.5_2_3 is 0.523; 0x10 is 16, 1:30 is 90, .nan): a number field takes the number, a text field the text
    as written (`written`), so a rollout-correction bound "0.5_2_3" is refused by its parser instead of running as
    0.523."""

    written: str


class SpelledFloat(float):
    __doc__ = SpelledInt.__doc__
    written: str


def _spelled(number: int | float, text: str) -> int | float:
    if NUMBER.fullmatch(text) and float(text) == number:
        return number
    out = SpelledInt(number) if isinstance(number, int) else SpelledFloat(number)
    out.written = text
    return out


def _int_or_float(loader: ConfigLoader, node: yaml.ScalarNode):
    """An integer too long for Python's conversion limit is read as the float it is (then refused by
    the range rules) instead of ending the load in a ValueError."""
    text = loader.construct_scalar(node)
    try:
        return _spelled(loader.construct_yaml_int(node), text)
    except ValueError:
        return _spelled(float(text.replace("_", "")), text)


def _float(loader: ConfigLoader, node: yaml.ScalarNode):
    return _spelled(loader.construct_yaml_float(node), loader.construct_scalar(node))


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _int_or_float)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _float)
