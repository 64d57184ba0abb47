"""verl's rollout-correction bounds ("2.0", "0.5_5.0", "0.5_2.0,1.0"), parsed strictly and in one place; the rules
(config/rules.py) report their problems and algo/rollout_correction.py receives the numbers."""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Union

from portagrpo.config.schema import Config
from portagrpo.fileio import shorten

# ---------------------------------------------------------------- rollout-correction bounds
# verl writes them as strings ("2.0", "0.5_5.0", "0.5_2.0,1.0"); they are parsed here, strictly and in one
# place, and algo/rollout_correction.py receives the numbers.

RC = "algorithm.rollout_correction"
NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # no "_", "nan", "inf", hex
IsThreshold = Union[float, tuple[float, float]]  # U: truncate above (TIS); (L, U): zero outside [L, U] (IcePop)
RsBounds = tuple[tuple[str, Optional[float], float], ...]  # (option, lower or None, upper) per rejection option


def _positive(text: str) -> float | None:
    """`text` as a finite positive number, or None."""
    value = float(text) if NUMBER.fullmatch(text) else math.nan
    return value if math.isfinite(value) and value > 0 else None


def _bound_pair(spec: Any) -> tuple[float | None, float] | None:
    """(L, U) from "L_U" with exactly two finite positive numbers and L < U; (None, U) from one; else None."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        return None
    parts = [p.strip() for p in (spec.split("_") if isinstance(spec, str) else [repr(float(spec))])]
    numbers = [_positive(p) for p in parts]
    if len(parts) > 2 or None in numbers:
        return None
    if len(parts) == 1:
        return None, numbers[0]
    return (numbers[0], numbers[1]) if numbers[0] < numbers[1] else None


def is_threshold(spec: Any) -> IsThreshold:
    """`rollout_is_threshold`: a number truncates the weights above it (TIS); "L_U" zeroes them outside
    [L, U] (IcePop). Anything else is a ValueError of one sentence."""
    pair = _bound_pair(spec)
    if pair is None:
        raise ValueError(f"{RC}.rollout_is_threshold={shorten(repr(spec))} must be a positive number (TIS truncates "
                         f"the weights above it) or 'L_U' with two positive numbers, L < U (IcePop), e.g. 2.0 or "
                         f"0.5_5.0.")
    lower, upper = pair
    return upper if lower is None else (lower, upper)


def rs_options(spec: Any) -> tuple[str, ...]:
    """`rollout_rs`: comma-separated rejection options (a repeated one counts once)."""
    from portagrpo.algo.rollout_correction import RS_OPTIONS

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{RC}.rollout_rs={shorten(repr(spec))} must name comma-separated options from "
                         f"{', '.join(RS_OPTIONS)} (or be null).")
    out: list[str] = []
    for name in (o.strip() for o in spec.split(",")):
        if name not in RS_OPTIONS:
            raise ValueError(f"{RC}.rollout_rs option {shorten(repr(name))} is unknown; use {', '.join(RS_OPTIONS)}.")
        if name not in out:
            out.append(name)
    return tuple(out)


def rs_bounds(options: tuple[str, ...], spec: Any) -> RsBounds:
    """`rollout_rs_threshold` for `options`: one spec for all, or one per option (comma-separated). A k1 option
    takes "L_U" or U (then L = 1/U, so U > 1) bounds on the ratio; k2/k3 options one upper bound."""
    key = f"{RC}.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{RC}.rollout_rs={','.join(options)} needs {key}: one bound for all options, or one per "
                         f"option (comma-separated).")
    specs = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else [spec]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{key}={shorten(repr(spec))} has {len(specs)} values for {len(options)} options; give "
                         f"one, or one per option.")
    out = []
    for option, text in zip(options, specs * len(options) if len(specs) == 1 else specs):
        pair = _bound_pair(text)
        if option.endswith("k1"):
            if pair is not None and pair[0] is None:
                pair = (1.0 / pair[1], pair[1]) if pair[1] > 1 else None
            need = "a number above 1 (the band [1/U, U]) or 'L_U' with two positive numbers, L < U"
        else:
            pair = pair if pair is not None and pair[0] is None else None
            need = "one positive number (an upper bound on the divergence)"
        if pair is None:
            raise ValueError(f"{key}={shorten(repr(spec))}: the bound {shorten(repr(text))} for {option} must be "
                             f"{need}.")
        out.append((option, pair[0], pair[1]))
    return tuple(out)


def correction_bounds(cfg: Config) -> tuple[IsThreshold | None, RsBounds]:
    """The parsed `algorithm.rollout_correction` bounds: the IS threshold (None when rollout_is is off) and the
    rejection options with their bounds (empty when rollout_rs is off). Raises ValueError (one sentence)."""
    rc = cfg.algorithm.rollout_correction
    # a bound is checked even where it is unused (rollout_is or rollout_rs off): never silently malformed
    threshold = None if rc.rollout_is_threshold is None else is_threshold(rc.rollout_is_threshold)
    if rc.rollout_rs is not None:
        rejection = rs_bounds(rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
    else:
        rejection = ()
        for text in [] if rc.rollout_rs_threshold is None else str(rc.rollout_rs_threshold).split(","):
            if _bound_pair(text) is None:
                raise ValueError(f"{RC}.rollout_rs_threshold={shorten(repr(rc.rollout_rs_threshold))}: "
                                 f"{shorten(repr(text.strip()))} is not a positive number or 'L_U' with two positive "
                                 f"numbers, L < U.")
    return (threshold if rc.rollout_is is not None else None), rejection


def rollout_correction_problems(cfg: Config) -> list[str]:
    rc, key = cfg.algorithm.rollout_correction, RC
    p: list[str] = []
    try:
        correction_bounds(cfg)
    except ValueError as err:
        p.append(str(err))
    if rc.bypass_mode and (rc.rollout_is is not None or rc.rollout_rs is not None):
        p.append(f"{key}.bypass_mode=true makes the sampler's log-probs the old ones, so the PPO ratio is already "
                 f"pi_train/pi_sampler and rollout_is/rollout_rs have nothing to correct (verl 0.9.1's trainer "
                 f"ignores them too); set bypass_mode=false to weight or reject, or drop rollout_is/rollout_rs.")
    return p
