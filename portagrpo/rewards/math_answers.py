"""MATH-style answers: the last \\boxed{...} of a text, and equivalence of two answers.

`math-verify` decides equivalence when installed; otherwise a string normalisation and a
sympy check of the difference stand in for it.
"""
from __future__ import annotations

import re


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start:].split(maxsplit=1)  # '\\boxed 5'
        return rest[1].strip().rstrip("$.") if len(rest) > 1 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i].strip()
    return None


_REPLACEMENTS = [(r"\left", ""), (r"\right", ""), (r"\!", ""), (r"\,", ""), (r"\;", ""), (r"\ ", ""),
                 (r"\dfrac", r"\frac"), (r"\tfrac", r"\frac"), (r"^{\circ}", ""), (r"^\circ", ""),
                 (r"\%", ""), ("%", ""), (r"\$", ""), ("$", "")]


def normalize_latex(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{([^}]*)\}", r"\1", s)
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def _to_sympy(s: str):
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    expr = s
    for _ in range(5):  # nested fractions and roots
        expr = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", expr)
        expr = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", expr)
    expr = expr.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("^", "**")
    expr = expr.replace("{", "(").replace("}", ")")
    return parse_expr(expr, transformations=standard_transformations + (implicit_multiplication_application,))


def is_equivalent(predicted: str, truth: str) -> bool:
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"${truth}$"), parse(f"${predicted}$")))
    except ImportError:
        pass
    a, b = normalize_latex(predicted), normalize_latex(truth)
    if a == b:
        return True
    try:
        import sympy

        diff = sympy.simplify(_to_sympy(a) - _to_sympy(b))
        return bool(diff == 0)
    except Exception:  # noqa: BLE001 - unparsable answers are simply not equal
        return False
