"""Tasks and reward functions from outside hacrl-fed: import paths and the ``hacrl_fed.tasks`` entry points.

``task.name`` is resolved in this order (:func:`resolve_task_class`):

1. a name in the built-in registry (``arithmetic``, ``jsonl``, ``dataset``, ``reasoning-gym``, or anything
   ``register_task`` added);
2. an import path ``package.module:ClassName`` (a :class:`~hacrl_fed.tasks.base.Task` subclass);
3. the name of an entry point in the group ``hacrl_fed.tasks`` of an installed distribution, e.g. in its
   ``pyproject.toml``::

       [project.entry-points."hacrl_fed.tasks"]
       my-task = "my_task.task:MyTask"

A reward function (``reward_fn`` of the ``jsonl`` and ``dataset`` tasks) is an import path
``package.module:function`` of a callable ``fn(response: str, reference: str) -> float``; :func:`load_reward_fn`
checks at start-up that it imports, is callable and takes those two arguments, and wraps it so a reward is always
a float in ``[0, 1]`` (an exception, a non-number or a non-finite value scores 0.0, counted in ``errors``).

Every problem is a :class:`~hacrl_fed.config.BuildError` naming the config field. Each process (the coordinator,
every worker) imports its own copy, so every org still verifies with code it runs itself.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel

from hacrl_fed.config import BuildError

ENTRY_POINT_GROUP = "hacrl_fed.tasks"
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*$")

log = logging.getLogger(__name__)


def is_import_path(spec: str) -> bool:
    """Whether ``spec`` looks like ``package.module:Attr`` (attribute may be dotted: ``mod:Cls.method``)."""
    return bool(_IMPORT_PATH.match(spec))


def load_object(spec: str, field: str) -> Any:
    """The object an import path ``package.module:attr`` names; :class:`BuildError` naming ``field`` when the
    path is malformed, the module does not import (with the error it raised) or the attribute is missing."""
    if not isinstance(spec, str) or not is_import_path(spec):
        raise BuildError(f"{field}: {spec!r} is not an import path of the form package.module:Name")
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise BuildError(f"{field}: cannot import module {module_name!r} ({type(err).__name__}: {err})") from err
    except Exception as err:  # a module that fails while importing: still a start-up error naming the field
        raise BuildError(f"{field}: importing {module_name!r} failed ({type(err).__name__}: {err})") from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise BuildError(f"{field}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return obj


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_tasks(registry: dict[str, Any]) -> list[str]:
    """Names ``task.name`` accepts besides import paths: the registry and the installed entry points."""
    return sorted(set(registry) | set(_entry_points()))


def _check_task_class(obj: Any, field: str, where: str, base: type) -> Any:
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise BuildError(f"{field}: {where} is {_describe(obj)}, not a subclass of hacrl_fed.tasks.Task")
    if inspect.isabstract(obj):
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        raise BuildError(f"{field}: {where} is abstract (does not implement {', '.join(missing)})")
    params = getattr(obj, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise BuildError(f"{field}: {where}.Params must be a TaskParams (pydantic) model, got {params!r}")
    return obj


def resolve_task_class(name: str, registry: dict[str, Any], base: type) -> Any:
    """The Task class ``task.name`` names (module docstring for the order): a subclass of ``base``
    (:class:`hacrl_fed.tasks.base.Task`, passed in so that this module sits below the task interface);
    :class:`BuildError` naming ``task.name`` for an unknown name, a bad import path, a broken entry point or an
    object that is not a Task."""
    if not isinstance(name, str) or not name:
        raise BuildError(f"task.name: must be a non-empty string, got {name!r}")
    if name in registry:
        return registry[name]
    if ":" in name:
        return _check_task_class(load_object(name, "task.name"), "task.name", repr(name), base)
    eps = _entry_points()
    if name in eps:
        ep = eps[name]
        try:
            obj = ep.load()
        except Exception as err:
            raise BuildError(
                f"task.name: entry point {name!r} ({ENTRY_POINT_GROUP}: {ep.value}) does not load "
                f"({type(err).__name__}: {err})"
            ) from err
        return _check_task_class(obj, "task.name", f"entry point {name!r} ({ep.value})", base)
    raise BuildError(
        f"task.name: unknown task {name!r}; available: {available_tasks(registry)} "
        "(or an import path package.module:ClassName)"
    )


def _describe(obj: Any) -> str:
    """``"a function"`` / ``"the class X"`` / ``"an int"``: what an import path named, for error lines."""
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    return f"a {type(obj).__name__} object"


class RewardFn:
    """A user reward function made safe to call on anything: ``reward(response, reference)`` is always a float
    in ``[0, 1]`` (values clipped; an exception, a non-number, NaN or inf score 0.0 and add one to ``errors``)."""

    def __init__(self, fn: Callable[[str, str], Any], spec: str) -> None:
        self.fn, self.spec, self.errors = fn, spec, 0

    def __call__(self, response: str, reference: str) -> float:
        try:
            value = self.fn(response, reference)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"returned {type(value).__name__} {value!r:.40}, not a finite number")
            return min(1.0, max(0.0, float(value)))
        except Exception as err:  # never crash a round on a user verifier
            self.errors += 1
            if self.errors == 1:
                log.warning(
                    "reward function %s failed (scored 0.0; logged once): %s: %s", self.spec, type(err).__name__, err
                )
            return 0.0


def load_reward_fn(spec: str, field: str) -> RewardFn:
    """Import ``spec`` (``package.module:function``) and check it is callable with ``(response, reference)``;
    :class:`BuildError` naming ``field`` otherwise."""
    fn = load_object(spec, field)
    if isinstance(fn, type) or not callable(fn):
        raise BuildError(f"{field}: {spec!r} is {_describe(fn)}, not a function fn(response, reference) -> float")
    try:
        inspect.signature(fn).bind("response", "reference")
    except TypeError as err:
        raise BuildError(f"{field}: {spec!r} cannot be called as fn(response, reference): {err}") from None
    except ValueError:  # builtins without a signature: accepted, guarded at call time
        pass
    return RewardFn(fn, spec)
