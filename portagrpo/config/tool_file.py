"""The tool file of a multi-turn run (`rollout.multi_turn.tool_config_path`), read and checked: config validation
and `--dry-run` list its problems with the rest, and the run builds its tools from it (agent/tools.py runs them).

The layout is verl's `tool_config_path`:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool      # or `callable: module:function | path/file.py:function`
        config: {type: native}
        tool_schema:
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {type: object, properties: ...}}
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portagrpo.errors import UserError
from portagrpo.fileio import UniqueKeyLoader, shorten

# verl's tool classes and our built-ins: the class name (or built-in name) -> "builtin:<name>"
BUILTIN_ALIASES = {
    "calculator": "calculator",
    "python": "python",
    "gsm8k": "gsm8k",
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "python",
}
SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
UNTRUSTED_BUILTINS = frozenset({"python"})  # built-ins that run code the model wrote
FIELD = "rollout.multi_turn.tool_config_path"
ENTRY_KEYS = ("class_name", "callable", "config", "tool_schema")
# `config` keys: `type` is verl's (`native` only), `builtin` picks a built-in by name, `network` (a user tool's)
CONFIG_KEYS = ("type", "builtin", "network")
# verl's SandboxFusionTool settings, accepted so its tool file loads unchanged; the sandbox's limits are
# rollout.multi_turn.tool_timeout_s and tool_memory_mb, not these (docs/config.md)
SANDBOX_FUSION_KEYS = ("sandbox_fusion_url", "num_workers", "enable_global_rate_limit", "rate_limit",
                       "default_timeout", "default_language", "memory_limit_mb")
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "object": (dict,), "array": (list,), "null": (type(None),)}
MAX_TOOL_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class ToolSpec:
    name: str
    target: str  # "builtin:<name>", "module:function" or "/abs/path/file.py:function"
    schema: dict = field(default_factory=dict)  # the OpenAI function schema (`tool_schema`)
    network: bool = False  # True: the tool keeps the network (a user tool whose config says `network: true`)
    untrusted: bool = False  # True: the tool runs code the model wrote (the `python` built-in, verl's SandboxFusion)

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters", {}) or {}


def tool_file_problems(path: str | Path) -> list[str]:
    """Every problem of a tool file, one sentence each (config validation and `--dry-run` list them with the rest)."""
    try:
        load_tool_config(path)
    except UserError as err:
        return str(err).splitlines()
    return []


def load_tool_config(path: str | Path) -> dict[str, ToolSpec]:
    """The tools a YAML tool file declares, by name. A bad file is refused with one sentence per problem (all of them
    at once), each naming the entry's field and the fix."""
    path = Path(path)
    entries = _read_entries(path)
    specs: dict[str, ToolSpec] = {}
    problems: list[str] = []
    for i, entry in enumerate(entries):
        spec = _tool_entry(entry, f"{FIELD}: tools[{i}]", path, problems)
        if spec is not None and spec.name in specs:
            problems.append(f"{FIELD}: tools[{i}] repeats the name {spec.name!r}; give every tool its own name.")
        elif spec is not None:
            specs[spec.name] = spec
    if problems:
        raise UserError("\n".join(problems))
    return specs


def _read_entries(path: Path) -> list:
    """The file's `tools:` list; a directory, a binary file, bad YAML or a key given twice is one sentence."""
    import yaml

    where = f"{FIELD}={shorten(str(path))!r}"
    try:
        if path.is_file() and path.stat().st_size > MAX_TOOL_FILE_BYTES:
            raise UserError(f"{where} is {path.stat().st_size} bytes, over the {MAX_TOOL_FILE_BYTES >> 20} MiB a tool "
                            f"file may have; give the YAML tool file itself.")
        text = path.read_bytes().decode("utf-8")
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except IsADirectoryError:
        raise UserError(f"{where} is a directory; give the path of a YAML tool file.") from None
    except OSError as err:
        raise UserError(f"{where} cannot be read ({err.strerror or type(err).__name__}); give a readable YAML tool "
                        f"file.") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{where} is not a text file (byte {err.start} is not UTF-8); give a YAML tool file with a "
                        f"`tools:` list.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        why = " ".join(str(getattr(err, "problem", None) or type(err).__name__).split())
        raise UserError(f"{where} is not valid YAML ({shorten(why)}{f' at line {mark.line + 1}' if mark else ''}); "
                        f"fix the file (its layout is in docs/config.md).") from None
    except RecursionError:
        raise UserError(f"{where} is not valid YAML (nested thousands of levels deep); fix the file.") from None
    except ValueError as err:  # an integer longer than Python converts
        raise UserError(f"{where} holds a value YAML cannot read ({shorten(str(err), 60)}); fix the file.") from None
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where} has no `tools:` list; declare at least one tool (see docs/config.md).")
    return entries


def _tool_entry(entry: Any, where: str, path: Path, problems: list[str]) -> ToolSpec | None:
    """The entry's ToolSpec, or None with its problems added to `problems`."""
    if not isinstance(entry, dict):
        problems.append(f"{where} is {_kind(entry)}, not a mapping; give class_name or callable, and "
                        f"tool_schema.")
        return None
    found = _unknown_keys(entry, ENTRY_KEYS, where) + _schema_problems(entry.get("tool_schema"), where)
    config = entry.get("config")
    if config is not None and not isinstance(config, dict):
        found.append(f"{where}.config={shorten(repr(config))} is {_kind(config)}; give a mapping, such as "
                     f"{{type: native}}, or leave config out.")
        config = None
    config = config or {}
    if "callable" in entry and "class_name" in entry:
        found.append(f"{where} gives both class_name and callable; keep the one that names the tool's code.")
    if "callable" in entry:
        target = _callable_target(entry["callable"], where, path, found)
    else:
        target = _builtin_target(entry.get("class_name"), config, where, found)
    found += _config_problems(config, where, builtin="callable" not in entry,
                              verl_sandbox=entry.get("class_name") == SANDBOX_FUSION)
    problems.extend(found)
    if found or target is None:
        return None
    name = entry["tool_schema"]["function"]["name"]
    builtin = target.removeprefix("builtin:") if target.startswith("builtin:") else None
    return ToolSpec(name, target, entry["tool_schema"], network=config.get("network", False) is True,
                    untrusted=builtin in UNTRUSTED_BUILTINS)


def _callable_target(target: Any, where: str, path: Path, problems: list[str]) -> str | None:
    module, _, function = target.rpartition(":") if isinstance(target, str) else ("", "", "")
    if not module or not function:
        problems.append(f"{where}.callable={shorten(repr(target))} is not module:function or path/file.py:function; "
                        f"name the tool's function that way.")
        return None
    if not module.endswith(".py"):
        return target
    file = Path(module) if Path(module).is_absolute() else (path.parent / module)
    if not file.is_file():
        problems.append(f"{where}.callable={target!r}: the file {str(file)!r} does not exist; give a path relative "
                        f"to the tool file, or an absolute one.")
        return None
    return f"{file.resolve()}:{function}"


def _builtin_target(cls: Any, config: dict, where: str, problems: list[str]) -> str | None:
    """A built-in by class_name, or by config.builtin (verl's own class names for a tool portagrpo builds in)."""
    names = [n for n in (cls, config.get("builtin")) if isinstance(n, str) and n in BUILTIN_ALIASES]
    if names:
        return f"builtin:{BUILTIN_ALIASES[names[0]]}"
    if cls is None:
        problems.append(f"{where} gives neither class_name nor callable; name a built-in tool "
                        f"({', '.join(sorted(BUILTIN_ALIASES))}) or callable: module:function.")
    else:
        problems.append(f"{where}.class_name={shorten(repr(cls))} is not a portagrpo tool; use one of "
                        f"{', '.join(sorted(BUILTIN_ALIASES))}, or give callable: module:function.")
    return None


def _kind(value: Any) -> str:
    """`value`'s YAML kind with its article: 'a string', 'an integer', 'a list'."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _unknown_keys(mapping: dict, known: tuple[str, ...], where: str) -> list[str]:
    problems = []
    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"{where} has an unknown key {shorten(repr(key), 40)}; {hint}the keys are "
                            f"{', '.join(known)}.")
    return problems


def _schema_problems(schema: Any, where: str) -> list[str]:
    """tool_schema: {type: function, function: {name, description, parameters}}, with the types argument checks use."""
    where = f"{where}.tool_schema"
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict):
        return [f"{where} has no function mapping; give tool_schema: {{type: function, function: {{name: ..., "
                f"description: ..., parameters: {{...}}}}}}."]
    where = f"{where}.function"
    problems = []
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append(f"{where}.name={shorten(repr(name))} is not a name; give the name the model calls the tool "
                        f"by, a non-empty string.")
    if not isinstance(fn.get("description", ""), str):
        problems.append(f"{where}.description is {_kind(fn['description'])}; give a string.")
    return problems + _parameters_problems(fn.get("parameters"), f"{where}.parameters")


def _parameters_problems(params: Any, where: str) -> list[str]:
    if params is None:
        return []
    if not isinstance(params, dict):
        return [f"{where}={shorten(repr(params))} is {_kind(params)}; give a mapping: {{type: object, "
                f"properties: {{NAME: {{type: string}}}}, required: [NAME]}}."]
    problems = []
    if params.get("type", "object") != "object":
        problems.append(f"{where}.type={shorten(repr(params['type']))} must be 'object' (a call's arguments are a "
                        f"JSON object).")
    props = params.get("properties")
    if props is not None and not isinstance(props, dict):
        problems.append(f"{where}.properties={shorten(repr(props))} is {_kind(props)}; give a mapping of "
                        f"argument names to {{type: ..., description: ...}}.")
        props = None
    for key, prop in (props or {}).items():
        problems += _property_problems(prop, f"{where}.properties.{shorten(str(key), 40)}")
    required = params.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        problems.append(f"{where}.required={shorten(repr(required))} must be a list of argument names, such as "
                        f"[{required if isinstance(required, str) else 'NAME'}].")
    elif required and props is not None:
        unknown = [r for r in required if r not in props]
        if unknown:
            problems.append(f"{where}.required names {', '.join(map(repr, unknown))}, which properties does not "
                            f"declare; declare it under properties or remove it from required.")
    return problems


def _property_problems(prop: Any, where: str) -> list[str]:
    if not isinstance(prop, dict):
        return [f"{where} is {_kind(prop)}; give a mapping such as {{type: string, description: ...}}."]
    kind = prop.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        return [f"{where}.type={shorten(repr(kind))} is not a JSON type; use one of {', '.join(JSON_TYPES)}."]
    return []


def _config_problems(config: dict, where: str, *, builtin: bool, verl_sandbox: bool) -> list[str]:
    where = f"{where}.config"
    known = CONFIG_KEYS if builtin else tuple(k for k in CONFIG_KEYS if k != "builtin")
    known += SANDBOX_FUSION_KEYS if verl_sandbox else ()
    problems = _unknown_keys(config, known, where)
    if "type" in config and config["type"] != "native":
        problems.append(f"{where}.type={shorten(repr(config['type']))} is not supported; portagrpo runs every tool "
                        f"in its own sandbox, so use type: native or leave it out.")
    network = config.get("network", False)
    if not isinstance(network, bool):
        problems.append(f"{where}.network={shorten(repr(network))} is {_kind(network)}, not a boolean; "
                        f"write network: true or network: false, without quotes.")
    elif network and builtin:
        problems.append(f"{where}.network=true: a built-in tool never gets the network; remove network, or give a "
                        f"callable tool of your own.")
    return problems
