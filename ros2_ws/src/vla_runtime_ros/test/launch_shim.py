"""Launch files evaluated without the launch system (it is not on PyPI): stand-in ``launch`` /
``launch_ros`` modules record what a launch file builds, and ``evaluate`` runs its ``OpaqueFunction``s
with the given launch arguments, as ``ros2 launch`` would, to list the nodes it would start."""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SHIMMED = {
    "launch": ["LaunchDescription"],
    "launch.actions": [
        "DeclareLaunchArgument", "IncludeLaunchDescription", "GroupAction", "SetEnvironmentVariable", "OpaqueFunction",
        "RegisterEventHandler", "Shutdown",
    ],
    "launch.event_handlers": ["OnProcessExit", "OnProcessIO"],
    "launch.substitutions": ["LaunchConfiguration", "PathJoinSubstitution", "TextSubstitution"],
    "launch_ros.actions": ["Node", "LifecycleNode", "PushRosNamespace"],
    "launch_ros.substitutions": ["FindPackageShare"],
    "launch_ros.parameter_descriptions": ["ParameterValue"],
}
SUPPORT_MODULES = ("vla_runtime_ros.launch_support", "vla_runtime_ros.launch_nodes")  # import launch: re-imported under each shim


class Recorded:
    """Stands in for a launch / launch_ros class: records its arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def kind(value) -> str:
    """The launch class ``value`` stands for ('' for anything else)."""
    return type(value).__name__ if isinstance(value, Recorded) else ""


def launch_shim() -> dict[str, types.ModuleType]:
    modules = {"launch_ros": types.ModuleType("launch_ros")}
    for module, classes in SHIMMED.items():
        mod = modules.setdefault(module, types.ModuleType(module))
        for cls in classes:
            setattr(mod, cls, type(cls, (Recorded,), {}))
    return modules


def load_launch(path: Path, monkeypatch) -> Recorded:
    """``generate_launch_description()`` of the launch file at ``path``, built from stand-ins."""
    for name, module in launch_shim().items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in SUPPORT_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate_launch_description()


class Configurations(dict):
    """``context.launch_configurations``: launch arguments as strings, remembering which were read."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)


@dataclass
class Context:
    launch_configurations: Configurations


@dataclass
class Evaluated:
    """What a launch file starts for some launch arguments."""

    declared: dict[str, Recorded]  # name -> DeclareLaunchArgument
    actions: list[Recorded]  # top-level actions, then what each OpaqueFunction returned
    configurations: Configurations

    @property
    def nodes(self) -> list[Recorded]:
        return [a for a in self.actions if kind(a) == "Node"]

    def value(self, value):
        """A Node argument as ``ros2 launch`` would pass it (LaunchConfigurations substituted)."""
        if kind(value) == "LaunchConfiguration":
            return self.configurations[value.args[0]]
        if isinstance(value, (list, tuple)):
            return type(value)(self.value(v) for v in value)
        return value


def evaluate(path: Path, monkeypatch, **arguments: str) -> Evaluated:
    """The launch file at ``path`` run with ``arguments`` (declared defaults for the rest; ``/path`` for
    defaults that are substitutions and for required arguments not given)."""
    description = load_launch(path, monkeypatch)
    actions = list(description.args[0])
    declared = {a.args[0]: a for a in actions if kind(a) == "DeclareLaunchArgument"}
    values = {}
    for name, argument in declared.items():
        default = argument.kwargs.get("default_value", "/path")
        values[name] = default if isinstance(default, str) else "/path"
    unknown = set(arguments) - set(declared)
    assert not unknown, f"{path.name} declares no {sorted(unknown)}"
    configurations = Configurations({**values, **arguments})
    context = Context(configurations)
    for action in list(actions):
        if kind(action) == "OpaqueFunction":
            actions.extend(action.kwargs["function"](context))
    return Evaluated(declared, actions, configurations)
