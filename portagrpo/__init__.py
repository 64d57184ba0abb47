"""portagrpo: GRPO/DrGRPO training with the same numbers on CUDA, ROCm, Ascend NPU and the CPU."""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# backends/ and kernels/ sit at the top of the source tree and are installed inside the package
# (pyproject's package-dir). A source tree that shadows the installed package, as `python -m portagrpo`
# run from the tree's root does (the current directory comes first on sys.path; the images keep their
# WORKDIR there), would lack both layers: there, they resolve from the tree's own top-level folders.
_LAYERS = ("backends", "kernels")
_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(_HERE)


class _SourceTreeLayers(importlib.abc.MetaPathFinder):
    """Finds `portagrpo.backends` and `portagrpo.kernels` in a source tree's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, layer = fullname.partition(".")
        if prefix != __name__ or layer not in _LAYERS:
            return None
        folder = os.path.join(_TREE, layer)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _in_source_tree() -> bool:
    return (not os.path.isdir(os.path.join(_HERE, _LAYERS[0]))
            and all(os.path.isfile(os.path.join(_TREE, layer, "__init__.py")) for layer in _LAYERS))


if _in_source_tree() and not any(isinstance(f, _SourceTreeLayers) for f in sys.meta_path):
    sys.meta_path.append(_SourceTreeLayers())
