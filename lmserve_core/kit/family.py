"""Family: what a model family's plugin module registers, in one declaration.

A family plugin's ``plugin.py`` declares its backends (names, the GGUF architectures each
serves), which model class serves an architecture and which conventions a file gets, and
hands out the family's hook and backend factory as its own::

    FAMILY = Family(
        "qwen3",
        model="lmserve_qwen3.model:Qwen3Model",
        conventions=CONVENTIONS,
        backends=[BackendSpec("qwen3", ("qwen3",), "Qwen3 GGUFs (dense)")],
    )
    create_backend = FAMILY.create_backend
    register_backends = FAMILY.register_backends

A family that converts transformers checkpoints to its GGUF layout (``lmserve convert``)
names its converters too, ``converters=[Converter("Qwen3ForCausalLM",
"lmserve_qwen3.convert:convert", "Qwen3 to a qwen3 GGUF")]``, and hands out
``register_converters = FAMILY.register_converters``.

The model class is imported only when a backend is created, so listing the installed
plugins never loads a family's native module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve_core.backend import ServerSettings
from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.hookspecs import hookimpl
from lmserve_core.model import FamilyConventions

__all__ = ["BackendSpec", "Converter", "Family"]


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One backend a family registers: ``--backend name``, and the architectures whose
    files pick it when ``--backend`` is not given."""

    name: str
    architectures: tuple[str, ...]
    description: str
    default_model: Callable[[], str | None] | None = None
    # a model path of its own that is not a GGUF file (``lmserve DIR``)
    recognizes: Callable[[str], bool] | None = None
    # its own options from the parsed flags (``ServerSettings.options``; the flags are added
    # by the plugin's ``register_options``), and a flag of them naming its model
    options: Callable[[Any], object] | None = None
    model_option: str | None = None


@dataclass(frozen=True, slots=True)
class Converter:
    """A converter ``lmserve convert`` offers: checkpoints whose ``config.json`` lists
    ``architecture`` go through ``convert`` (``"module:function"``, imported when it runs, as
    ``function(hf_dir: Path, out: Path, outtype: str) -> Path``)."""

    architecture: str
    convert: str
    description: str


class Family:
    """A model family: its backends, the model class of each architecture and the
    conventions of a file.

    ``model`` names the model class as ``"module:Class"``, or one per architecture; ``chat``
    names, per architecture, a subclass of :class:`~lmserve_core.gguf_chat.GGUFChatBackend`
    that serves it instead of the generic one (a model that does not generate token by
    token);
    ``conventions`` are the file's conventions, or a function of the opened file giving
    them. ``open`` opens a model path as a :class:`GGUFFile` (default
    :meth:`GGUFFile.open`): a family whose models are not GGUF files (a training checkpoint)
    presents them as one in memory, given the server's settings. :attr:`create_backend` is
    the factory every backend registers (one object, so a plugin module can hand it out as
    its own)."""

    def __init__(
        self,
        name: str,
        *,
        model: str | Mapping[str, str],
        conventions: FamilyConventions | Callable[[GGUFFile], FamilyConventions],
        backends: Sequence[BackendSpec],
        open: Callable[[str, ServerSettings], GGUFFile] | None = None,
        chat: Mapping[str, str] | None = None,
        converters: Sequence[Converter] = (),
    ) -> None:
        if not backends:
            raise ValueError("a family registers at least one backend")
        self.name = name
        self._model = model
        self._conventions = conventions
        self._open = open
        self._chat = dict(chat or {})
        self.converters = tuple(converters)
        self.backends = tuple(backends)
        self.architectures = tuple(a for spec in self.backends for a in spec.architectures)
        if not isinstance(model, str) and set(model) != set(self.architectures):
            raise ValueError(f"the {name} family names no model class for some architecture")
        self.create_backend: Callable[[str | None, ServerSettings], Any] = self._create_backend

    def model_class(self, architecture: str) -> Any:
        """The model class of an architecture (its module imported now)."""
        path = self._model if isinstance(self._model, str) else self._model[architecture]
        return _imported(path)

    def chat_class(self, architecture: str) -> Any:
        """The chat backend class of an architecture (GGUFChatBackend unless ``chat`` names
        one)."""
        from lmserve_core.gguf_chat import GGUFChatBackend

        path = self._chat.get(architecture)
        return GGUFChatBackend if path is None else _imported(path)

    def conventions(self, gguf: GGUFFile) -> FamilyConventions:
        """The conventions a file gets (its chat template may choose them)."""
        c = self._conventions
        return c if isinstance(c, FamilyConventions) else c(gguf)

    def _create_backend(self, model_path: str | None, settings: ServerSettings) -> Any:
        """Open the GGUF, build the forward pass of its architecture and wrap it in the
        generic chat path."""
        path = model_path
        if path is None:
            defaults = [s.default_model for s in self.backends if s.default_model is not None]
            path = next((p for p in (d() for d in defaults) if p), None)
        if path is None:
            raise FileNotFoundError(
                f"the {self.name} backend needs a model file (lmserve --backend "
                f"{self.backends[0].name} model.gguf)"
            )
        gguf = GGUFFile.open(path) if self._open is None else self._open(path, settings)
        try:
            arch = gguf.architecture
            if arch not in self.architectures:
                raise GGUFError(
                    f"architecture {arch!r} is not served by the {self.name} family "
                    f"({', '.join(self.architectures)})"
                )
            model = self.model_class(arch).load(
                gguf, n_threads=settings.threads, kv_type=settings.kv_type
            )
            conventions = self.conventions(gguf)
            chat = self.chat_class(arch)
        except BaseException:
            gguf.close()
            raise
        return chat(
            name=arch, gguf=gguf, model=model, conventions=conventions, settings=settings,
            family=self.name,
        )

    @hookimpl
    def register_backends(self, register: Any) -> None:
        """The ``register_backends`` hook: every backend of the family (a plugin module
        hands it out as ``register_backends = FAMILY.register_backends``)."""
        for spec in self.backends:
            kwargs: dict[str, Any] = {}
            if spec.default_model is not None:
                kwargs["default_model"] = spec.default_model
            for name in ("recognizes", "options", "model_option"):
                if getattr(spec, name) is not None:
                    kwargs[name] = getattr(spec, name)
            register(
                spec.name,
                self.create_backend,
                architectures=spec.architectures,
                description=spec.description,
                **kwargs,
            )

    @hookimpl
    def register_converters(self, register: Any) -> None:
        """The ``register_converters`` hook: every converter of the family (handed out as
        ``register_converters = FAMILY.register_converters``)."""
        for converter in self.converters:

            def convert(hf_dir: Path, out: Path, outtype: str, _path: str = converter.convert
                        ) -> Path:
                result: Path = _imported(_path)(hf_dir, out, outtype)
                return result

            register(converter.architecture, convert, description=converter.description)


def _imported(path: str) -> Any:
    """The object ``"module:attribute"`` names (its module imported now)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
