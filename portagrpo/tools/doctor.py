"""`portagrpo doctor`: what this machine has, per backend."""
from __future__ import annotations

import platform
from typing import Any


def collect() -> dict[str, Any]:
    from portagrpo.backends import all_backends
    from portagrpo.backends.npu_env import autoload_disabled_reason
    from portagrpo.backends.probe import package_versions, torch_build

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_build": torch_build(),
        "packages": package_versions(),
        "notes": [autoload_disabled_reason] if autoload_disabled_reason else [],
        "backends": [b.describe() for b in all_backends()],
    }


def render(info: dict[str, Any]) -> str:
    lines = [f"python {info['python']} on {info['platform']}"]
    tb = info["torch_build"]
    lines.append(f"torch {tb['version']} (cuda={tb['cuda']}, hip={tb['hip']})")
    lines.append("packages: " + ", ".join(f"{k} {v or '-'}" for k, v in info["packages"].items()))
    lines += [f"note: {n}" for n in info["notes"]]
    head = (f"{'backend':8} {'ok':3} {'devices':>7}  {'collective':10} {'bf16':5} {'attention fp32/bf16':26} "
            f"{'kernel':9} names / reason")
    lines += ["", head, "-" * len(head)]
    for r in info["backends"]:
        attn = f"{r['attention']['fp32'] or '-'}/{r['attention']['bf16'] or '-'}"
        detail = ", ".join(r["device_names"]) if r["available"] else r["reason"]
        bf16 = "-" if r["bf16"] is None else ("yes" if r["bf16"] else "no")
        lines.append(f"{r['backend']:8} {'yes' if r['available'] else 'no':3} {r['device_count']:>7}  "
                     f"{r['dist_backend']:10} {bf16:5} {attn:26} {r['kernel'] or '-':9} {detail}")
    return "\n".join(lines)

