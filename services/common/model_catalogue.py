"""Which base models a worker can serve, by name: its model catalogue.

Every model directory (one holding config.json) under $TANDEM_HOME/models, plus each `--model`
flag: `NAME=DIR` serves DIR as NAME, a bare `DIR` serves it under its directory's name. The first
`--model` (none: the default model) is the worker's primary model, loaded at start. Torch-free,
so the gateway and the scheduler read catalogues with the workers' own rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.model_store import ensure_default_model, model_name, models_dir

MODEL_CONFIG = "config.json"


class ModelCatalogueError(ValueError):
    """A --model flag that cannot be served; the message says what to write instead."""


class UnknownModelError(ModelCatalogueError):
    """A model name outside the catalogue."""


@dataclass(frozen=True, slots=True)
class ModelCatalogue:
    """Model directories by served name; `primary` is one of them."""

    models: Mapping[str, Path]
    primary: str

    @classmethod
    def from_flags(cls, models: Iterable[str], home: Path | None = None,
                   default_model: Callable[[], Path] = ensure_default_model) -> ModelCatalogue:
        """The catalogue of `--model` flags (NAME=DIR or DIR) over the model directories under
        `home`/models (none: $TANDEM_HOME/models). A flag's name wins over a directory found there."""
        named = _named(models)
        if not named:
            default = default_model()
            named = {model_name(default): default}
        found = _model_dirs(models_dir() if home is None else home / "models")
        return cls(models={**named, **{n: d for n, d in found.items() if n not in named}}, primary=next(iter(named)))

    def names(self) -> tuple[str, ...]:
        """The primary model first, then the rest in catalogue order."""
        return (self.primary, *(name for name in self.models if name != self.primary))

    def path(self, name: str) -> Path:
        """The directory of model `name`; UnknownModelError naming the catalogue when it has none."""
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModelError(
                f"model {name!r} is not in this worker's catalogue ({', '.join(self.names())}); put its "
                f"directory under $TANDEM_HOME/models or start the worker with --model {name}=DIR"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self.models


def parse_model_flag(item: str) -> tuple[str, Path]:
    """'NAME=DIR' -> (NAME, DIR); 'DIR' -> (its directory's name, DIR). DIR must hold config.json."""
    name, sep, directory = item.partition("=")
    if not sep or "/" in name:  # a bare path (one whose '=' comes after a '/')
        name, directory = model_name(item), item
    if not name or not directory or ":" in name:
        raise ModelCatalogueError(f"--model takes DIR or NAME=DIR with a NAME without ':', got {item!r}")
    path = Path(directory).expanduser()
    if not (path / MODEL_CONFIG).is_file():
        raise ModelCatalogueError(f"--model {item}: {path} is not a model directory (no {MODEL_CONFIG})")
    return name, path


def _named(models: Iterable[str]) -> dict[str, Path]:
    named: dict[str, Path] = {}
    for item in models:
        name, path = parse_model_flag(item)
        if name in named:
            raise ModelCatalogueError(
                f"--model names {name!r} twice ({named[name]} and {path}); serve one under another "
                f"name with --model NAME=DIR"
            )
        named[name] = path
    return named


def _model_dirs(root: Path) -> dict[str, Path]:
    """Every model directory right under `root` (hidden ones, such as a conversion's staging, left out)."""
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if not d.name.startswith(".") and (d / MODEL_CONFIG).is_file()}
