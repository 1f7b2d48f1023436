"""`InterpolationMode`, as SGLang's model configs import it; nothing else."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


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
