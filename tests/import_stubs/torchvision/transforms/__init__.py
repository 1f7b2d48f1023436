"""An import-time stand-in for torchvision.transforms, for SGLang's modules on a CPU-only test machine.

Importing SGLang's host KV pools imports its model registry, and two model configs there
import `torchvision.transforms` at module level. torchvision's wheels on PyPI are built
against CUDA torch and do not load with the CPU torch the tests use. The tests put this
directory on `sys.path` only when no real torchvision is importable; it provides the names
those imports bind, each failing loudly if called. `torchvision` itself is a namespace
package here, with no version and no file, so libraries that probe for torchvision
(transformers) find none.
"""

from . import functional
from .functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str) -> object:
    """Any other name: a stand-in that fails when used, so importing modules that bind it works."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"{__name__}.{name}")


def _unavailable(what: str) -> object:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{what}: torchvision is an import stub here (see torchvision/__init__.py)")

    unavailable.__qualname__ = what
    return unavailable
