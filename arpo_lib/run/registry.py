"""Registries: every extension point of the workbench as a name -> entry table, and plug-ins.

A registry is the single source of truth for the names a config may use: the module that owns
an extension point registers its built-in entries, a plug-in registers more, and config
validation (`arpo_lib.run.config.validate`) checks names against the registry.

    @POLICY_LOSSES.register("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, mask, cfg, *, ref_logprobs=None, is_weights=None): ...

    PROMPTS.register("terse", Prompt(...))          # the same register() as a call

Why the registries live here, on the ground floor, while their entries are registered by the
layers above: validation is on the ground floor and may import nothing above it, and a plug-in
(or an environment worker importing one) should reach a registry without importing its owner's
heavy dependencies (torch for the losses). So each registry knows the module path of its `home`,
the module whose import registers the built-in entries, and imports it by name the first time
it is consulted. That is the one place where the ground floor names the floors above, and it is
the table below.

Plug-ins: a run's config names modules to import before it is validated (`plugins:` in the
config); environment workers in other processes import them too (arpo_lib/envs/workers/worker.py), so a
plug-in's environment family exists where environments are made. Keep a plug-in's top-level
imports light (import torch inside the functions that need it): workers stay torch-free.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no entry of a registry has; the message names the registry and its entries.

    A KeyError (a registry is a mapping) and a ValueError (what a bad argument raises)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one kind (`kind`: "policy loss", "prompt", ...): a read-only mapping plus
    `register`. `home`: the module whose import registers the built-in entries, imported the
    first time the registry is read; `key`: the config key whose values are its names."""

    def __init__(self, kind: str, home: str | None = None, key: str | None = None):
        self.kind = kind
        self.home = home
        self.key = key
        self._entries: dict[str, T] = {}
        self._origins: dict[str, str] = {}
        self._loaded = home is None
        self._lock = threading.RLock()

    @overload
    def register(self, name: str, *, origin: str | None = None) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, entry: T, *, origin: str | None = None) -> T: ...

    def register(self, name: str, entry: Any = None, *, origin: str | None = None) -> Any:
        """Add `entry` under `name`; without `entry`, a decorator that adds what it decorates.
        A name taken by another entry is refused (registering the same object again is not).
        `origin`: the module registering, for messages (default: the caller's)."""
        origin = origin or sys._getframe(1).f_globals.get("__name__", "?")
        if entry is None:
            return lambda obj: self._add(name, obj, origin)
        return self._add(name, entry, origin)

    def _add(self, name: str, entry: Any, origin: str) -> Any:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        with self._lock:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._origins[name]}); "
                                 "choose another name")
            self._entries[name] = entry
            self._origins[name] = origin
        return entry

    def origin(self, name: str) -> str:
        """The module that registered `name`."""
        self[name]
        return self._origins[name]

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if not self._loaded:
                importlib.import_module(self.home)  # its import registers the built-in entries
                self._loaded = True

    def __getitem__(self, name: str) -> T:
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownName(self.unknown(name)) from None

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def unknown(self, name: Any) -> str:
        """Why `name` is not an entry: the kind, the registered names, the closest ones."""
        known = list(self)
        close = difflib.get_close_matches(name, known, n=3) if isinstance(name, str) else []
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; registered: {', '.join(known) or 'none'}"

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


# ---- the workbench's extension points ------------------------------------------------------------

ADV_ESTIMATORS: Registry[Callable[[Any, Any], Any]] = Registry("advantage estimator", home="arpo_lib.algo.advantages",
                                         key="algo.adv_estimator")
"""`estimator(rewards, cfg) -> advantages`: rewards (G,) float64 of one group, cfg the run's
`AlgoConfig`; returns (G,) advantages (arpo_lib/algo/advantages.py)."""

POLICY_LOSSES: Registry[Callable[..., tuple[Any, dict[str, float]]]] = Registry("policy loss", home="arpo_lib.algo.loss", key="algo.policy_loss")
"""`loss(logprobs, old_logprobs, advantages, mask, cfg, *, ref_logprobs=None, is_weights=None)
-> (loss, metrics)`: (B, T) token log-probs, (B,) advantages, (B, T) mask, cfg the run's
`AlgoConfig`; returns a scalar tensor and a dict of floats (arpo_lib/algo/loss.py)."""

COMPARISON_ARMS: Registry[Mapping[str, Any]] = Registry("comparison arm", home="arpo_lib.algo.arms", key="compare.algos")
"""Arm name -> the dotted config overrides its runs make (arpo_lib/algo/arms.py)."""

LR_SCHEDULES: Registry[Callable[[float, float], float]] = Registry("lr schedule", home="arpo_lib.training.optim",
                                                                  key="train.lr_schedule")
"""`shape(progress, min_lr_ratio) -> factor` after the warm-up, progress in [0, 1]
(arpo_lib/training/optim.py)."""

OPTIMIZERS: Registry[Callable[[list[Any], float, float], Any]] = Registry("optimizer", home="arpo_lib.training.optim",
                                                                       key="train.optimizer")
"""`make(params, lr, weight_decay) -> torch.optim.Optimizer` (arpo_lib/training/optim.py: `adamw`,
`adafactor`)."""

PROMPTS: Registry[Any] = Registry("prompt", home="arpo_lib.agent.prompt_library", key="agent.prompt")
"""Name -> `Prompt` (arpo_lib/agent/prompt_library.py)."""

EVAL_PROTOCOLS: Registry[Any] = Registry("evaluation protocol", home="arpo_lib.evaluation.protocols",
                                         key="eval.protocol")
"""Name -> `EvalProtocol` (arpo_lib/evaluation/protocols.py)."""

ENV_FAMILIES: Registry[Any] = Registry("environment family", home="arpo_lib.envs", key="env.tasks")
"""Prefix -> `EnvFamily` (arpo_lib/envs/__init__.py); task names are `<prefix>/<task>`."""


# ---- plug-ins ----------------------------------------------------------------------------------

class PluginError(ImportError):
    """A plug-in module named by a config cannot be imported."""


def import_plugins(modules: Iterable[str]) -> None:
    """Import each module (dotted name) once, so that its registrations happen; a module already
    imported is not run again."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise PluginError(f"plug-in {name!r} cannot be imported: {type(exc).__name__}: {exc}") from exc


def plugin_path(modules: Iterable[str]) -> list[str]:
    """The directories the plug-in modules are imported from (their sys.path entries), for a
    process started with another interpreter, whose path holds only arpo_lib. Site-packages
    directories are left out: they would bring every package of ours along."""
    paths: list[str] = []
    for name in modules:
        top = name.partition(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            where = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        elif spec.origin and os.path.isfile(spec.origin):
            where = os.path.dirname(os.path.abspath(spec.origin))
        else:
            continue
        if os.path.basename(where) not in ("site-packages", "dist-packages") and where not in paths:
            paths.append(where)
    return paths
