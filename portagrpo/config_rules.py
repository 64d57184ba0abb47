"""Value rules the types cannot express: every number finite and in its range, the tiny model's
shape consistent, and YAML files without duplicate keys. One sentence per problem, naming the field."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import yaml

# Float fields where infinity means something (no clipping).
INFINITY_ALLOWED = {"actor.grad_clip", "algorithm.reward_clip", "algorithm.advantage_clip"}


def _floats(obj: Any, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _floats(value, name + ".")
        elif isinstance(value, float):
            yield name, value
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            for i, v in enumerate(value):
                yield f"{name}[{i}]", v


def value_problems(cfg) -> list[str]:
    p: list[str] = []
    for name, value in _floats(cfg):
        if math.isnan(value) or (math.isinf(value) and name not in INFINITY_ALLOWED):
            p.append(f"{name}={value} must be a finite number.")
    if p:
        return p
    a, alg, r, t = cfg.actor, cfg.algorithm, cfg.rollout, cfg.trainer
    if not a.lr > 0:
        p.append(f"actor.lr={a.lr} must be positive.")
    if not a.grad_clip > 0:
        p.append(f"actor.grad_clip={a.grad_clip} must be positive (0 would zero every gradient and a negative value "
                 f"flip its sign); use .inf to turn clipping off.")
    if len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas):
        p.append(f"actor.betas={list(a.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
    if a.weight_decay < 0:
        p.append(f"actor.weight_decay={a.weight_decay} must be 0 or positive.")
    if a.warmup_steps < 0:
        p.append(f"actor.warmup_steps={a.warmup_steps} must be 0 or positive.")
    for name, value in (("actor.kl_loss_coef", a.kl_loss_coef), ("algorithm.kl_coef", alg.kl_coef)):
        if value < 0:
            p.append(f"{name}={value} must be 0 or positive (a negative coefficient rewards drifting from the reference).")
    if r.top_k < -1:
        p.append(f"rollout.top_k={r.top_k} must be -1 or 0 (off) or positive.")
    if not 0 <= r.min_p < 1:
        p.append(f"rollout.min_p={r.min_p} must be in [0, 1) (0 is off).")
    if not r.repetition_penalty > 0:
        p.append(f"rollout.repetition_penalty={r.repetition_penalty} must be positive (1 is off).")
    if r.val_temperature <= 0 and r.val_n > 1 and t.test_freq:
        p.append(f"rollout.val_n={r.val_n} with greedy validation (rollout.val_temperature=0) gives {r.val_n} identical "
                 f"samples, so pass@{r.val_n} would equal accuracy; set val_temperature > 0 or val_n=1.")
    if r.val_temperature < 0:
        p.append(f"rollout.val_temperature={r.val_temperature} must be 0 (greedy) or positive.")
    if r.val_n < 1 and t.test_freq:
        p.append(f"rollout.val_n={r.val_n} must be at least 1 while validation is on (trainer.test_freq={t.test_freq}).")
    if t.total_steps is None and t.total_epochs < 1:
        p.append(f"trainer.total_epochs={t.total_epochs} must be at least 1 (or set trainer.total_steps).")
    for name, value in (("algorithm.reward_clip", alg.reward_clip), ("algorithm.advantage_clip", alg.advantage_clip)):
        if value is not None and not value > 0:
            p.append(f"{name}={value} must be positive (or null for no clipping).")
    if cfg.model.path is None:
        p.extend(tiny_problems(cfg.model.tiny))
    return p


def tiny_problems(tiny) -> list[str]:
    p = [f"model.tiny.{name}={getattr(tiny, name)} must be at least 1."
         for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size") if getattr(tiny, name) < 1]
    if not p and tiny.hidden_size % tiny.num_heads:
        p.append(f"model.tiny.num_heads={tiny.num_heads} does not divide model.tiny.hidden_size={tiny.hidden_size}; "
                 f"pick a divisor of it.")
    elif not p and (tiny.hidden_size // tiny.num_heads) % 2:
        p.append(f"model.tiny.hidden_size / num_heads = {tiny.hidden_size // tiny.num_heads} must be even (rotary "
                 f"embeddings rotate pairs); change one of them.")
    return p


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (the last would silently win)."""


def _mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                            f"merge the two into one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
