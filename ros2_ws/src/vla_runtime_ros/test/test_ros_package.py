"""The ament_python package checked statically (no ROS launch system here): package.xml, setup.py,
launch files, parameter YAMLs and the README agree with the code."""

import ast
import importlib.metadata
import io
import sys
import types
import xml.etree.ElementTree as ET
from glob import glob
from pathlib import Path

import pytest
import yaml

pytest.importorskip("rclpy")

from launch_shim import Recorded, evaluate, kind  # noqa: E402
from vla_runtime_ros.param_specs import config_from_params, param_specs  # noqa: E402
from vla_runtime_ros.params import PlannerNodeConfig, PolicyNodeConfig, SimNodeConfig  # noqa: E402
from vla_runtime_ros.runner import parse_process_args  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[2]
SOURCES = sorted((PACKAGE / "vla_runtime_ros").glob("*.py"))
NODE_CONFIGS = {"policy_node": PolicyNodeConfig, "sim_node": SimNodeConfig, "planner_node": PlannerNodeConfig}
CONFIG_FILES = {"sim.yaml": SimNodeConfig, "sim_memory.yaml": SimNodeConfig, "planner.yaml": PlannerNodeConfig}  # every other config/*.yaml configures the policy node


def package_xml() -> ET.Element:
    return ET.parse(PACKAGE / "package.xml").getroot()


def setup_call() -> dict:
    """The keyword arguments of setup(...) in setup.py, evaluated where they are literals or globs."""
    tree = ast.parse((PACKAGE / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    scope = {"glob": lambda pattern: glob(str(PACKAGE / pattern)), "sorted": sorted, "package_name": "vla_runtime_ros",
             "find_packages": lambda **kw: ["vla_runtime_ros"]}
    return {kw.arg: eval(compile(ast.Expression(kw.value), "setup.py", "eval"), scope) for kw in call.keywords}  # noqa: S307


def test_package_xml_is_format_3_ament_python_named_like_the_directory():
    root = package_xml()
    assert root.get("format") == "3"
    assert root.findtext("name") == PACKAGE.name == "vla_runtime_ros"
    assert root.find("export/build_type").text == "ament_python"
    assert root.findtext("buildtool_depend") == "ament_python"
    assert root.find("maintainer").get("email") and root.findtext("license")


def test_package_xml_declares_every_ros_package_the_code_imports():
    """Imports whose PyPI distribution is a ROS wheel (ros-<pkg>) must be exec_depends of package.xml."""
    distributions = importlib.metadata.packages_distributions()
    imported = set()
    for source in SOURCES:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    ros = {m for m in imported if any(d.startswith("ros-") for d in distributions.get(m, []))}
    assert {"rclpy", "sensor_msgs", "std_srvs", "diagnostic_msgs"} <= ros  # the scan sees the ROS imports
    depends = {e.text for e in package_xml().findall("exec_depend")}
    assert ros - depends == set(), f"add to package.xml <exec_depend>: {sorted(ros - depends)}"
    assert {"launch", "launch_ros"} <= depends  # used by launch/*.launch.py


def test_setup_py_installs_launch_config_and_the_resource_marker():
    kwargs = setup_call()
    assert kwargs["name"] == "vla_runtime_ros"
    data = {target: [Path(f).name for f in files] for target, files in kwargs["data_files"]}
    assert data["share/ament_index/resource_index/packages"] == ["vla_runtime_ros"]
    assert (PACKAGE / "resource" / "vla_runtime_ros").is_file()
    assert data["share/vla_runtime_ros"] == ["package.xml"]
    assert sorted(data["share/vla_runtime_ros/launch"]) == sorted(p.name for p in (REPO / "launch").glob("*.launch.py"))
    assert len(data["share/vla_runtime_ros/launch"]) >= 2  # launch/ in the package is the repository's launch/
    assert sorted(data["share/vla_runtime_ros/config"]) == sorted(p.name for p in (PACKAGE / "config").iterdir())
    assert "fastdds_large_frames.xml" in data["share/vla_runtime_ros/config"]
    cfg = (PACKAGE / "setup.cfg").read_text()
    assert "script_dir=$base/lib/vla_runtime_ros" in cfg and "install_scripts=$base/lib/vla_runtime_ros" in cfg


def test_entry_points_name_main_functions_that_exist():
    entries = dict(e.split(" = ") for e in setup_call()["entry_points"]["console_scripts"])
    assert set(entries) == set(NODE_CONFIGS)
    for target in entries.values():
        module, function = target.split(":")
        tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text())
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, target


# ---------------------------------------------------------------------------------------- launch
def configurations(value) -> set[str]:
    """Names of every LaunchConfiguration inside ``value``."""
    if kind(value) == "LaunchConfiguration":
        return {value.args[0]}
    if isinstance(value, Recorded):
        return configurations(list(value.args) + list(value.kwargs.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(configurations(v) for v in value)) if value else set()
    if isinstance(value, dict):
        return configurations(list(value.values()))
    return set()


LAUNCH_FILES = sorted((REPO / "launch").glob("*.launch.py"))


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_arguments_map_to_things_that_exist(path, monkeypatch):
    run = evaluate(path, monkeypatch, **({"sim": "true"} if "bringup" in path.name else {}))
    declared = run.declared
    assert {"checkpoint", "params_file", "namespace", "respawn", "respawn_delay"} <= set(declared)
    assert run.nodes and all(a.kwargs.get("description") for a in declared.values())

    used = set(run.configurations.read)
    for node in run.nodes:
        assert node.kwargs["package"] == "vla_runtime_ros"
        config = NODE_CONFIGS[node.kwargs["executable"]]
        names = {spec.name for spec in param_specs(config)}
        used |= configurations(node.kwargs.get("namespace"))
        used |= configurations(node.kwargs.get("remappings", []))
        for entry in node.kwargs["parameters"]:
            if isinstance(entry, dict):  # each key is a parameter the node declares
                assert set(entry) <= names, f"{path.name}: {sorted(set(entry) - names)} are not parameters of {config.__name__}"
            used |= configurations(entry)
    assert used <= set(declared), f"{path.name} uses undeclared arguments {sorted(used - set(declared))}"
    assert set(declared) <= used, f"{path.name} declares unused arguments {sorted(set(declared) - used)}"

    # default parameter files exist in config/ (FindPackageShare -> share/vla_runtime_ros = this package)
    for name, argument in declared.items():
        default = argument.kwargs.get("default_value")
        if kind(default) == "PathJoinSubstitution":
            parts = default.args[0]
            assert kind(parts[0]) == "FindPackageShare" and parts[0].args[0] == "vla_runtime_ros"
            assert (PACKAGE / Path(*parts[1:])).is_file(), f"{name} defaults to a missing file {parts[1:]}"


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_every_launched_node_is_supervised(path, monkeypatch):
    """Each node: exit-with-parent (an option its process accepts), no respawn by default, an exit handler."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # launch's output redirected
    run = evaluate(path, monkeypatch)
    watchers = [a for a in run.actions if kind(a) == "RegisterEventHandler"]
    for node in run.nodes:
        assert parse_process_args(["node", *node.kwargs["arguments"]]).exit_with_parent
        assert node.kwargs["respawn"] is False and callable(node.kwargs["on_exit"])
        assert node.kwargs["output"] == "screen" and node.kwargs["emulate_tty"] is False
        assert [w.args[0].kwargs["target_action"] for w in watchers].count(node) == 1, "one output watcher per node"


def fake_exit(code: int) -> types.SimpleNamespace:
    """A launch ProcessExited event of the node /left/vla_policy."""
    return types.SimpleNamespace(action=types.SimpleNamespace(node_name="/left/vla_policy"), returncode=code)


def test_a_node_exit_stops_the_launch_with_its_exit_code_and_reason(monkeypatch):
    run = evaluate(REPO / "launch" / "vla_policy.launch.py", monkeypatch, namespace="left")
    (node,) = run.nodes
    (watcher,) = [a.args[0] for a in run.actions if kind(a) == "RegisterEventHandler"]
    output = "\x1b[31m[ERROR] [1.5] [left.vla_policy]: configure failed: no config.json\x1b[0m\n[FATAL] [1.6] " \
        "[left.vla_policy]: could not start: configure failed: no config.json\n[INFO] [1.7] [rcl]: bye\n"
    watcher.kwargs["on_stderr"](types.SimpleNamespace(text=output.encode()))
    from vla_runtime_ros.launch_support import NodeFailed

    with pytest.raises(NodeFailed, match=r"^/left/vla_policy exited with code 1: could not start: configure failed: no config.json$"):
        node.kwargs["on_exit"](fake_exit(1), None)
    for code in (0, -2):  # a node that ended by itself, or was interrupted while starting, ends the launch
        (shutdown,) = node.kwargs["on_exit"](fake_exit(code), None)
        assert kind(shutdown) == "Shutdown" and shutdown.kwargs["reason"] == "/left/vla_policy ended"
    with pytest.raises(NodeFailed, match="exited with code -9"):  # killed
        node.kwargs["on_exit"](fake_exit(-9), None)


def test_respawn_restarts_instead_of_stopping_but_not_the_simulator(monkeypatch):
    run = evaluate(REPO / "launch" / "vla_sim.launch.py", monkeypatch, respawn="true", respawn_delay="2.5")
    nodes = {n.kwargs["executable"]: n for n in run.nodes}
    policy, sim = nodes["policy_node"], nodes["sim_node"]
    assert (policy.kwargs["respawn"], policy.kwargs["respawn_delay"]) == (True, 2.5)
    assert policy.kwargs["on_exit"](fake_exit(1), None) is None  # launch restarts it
    assert sim.kwargs["respawn"] is False  # the end of the run ends the launch
    with pytest.raises(ValueError, match="respawn is 'sometimes'; expected true or false"):
        evaluate(REPO / "launch" / "vla_policy.launch.py", monkeypatch, respawn="sometimes")


def test_colour_codes_only_when_launch_writes_to_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert all(n.kwargs["emulate_tty"] is True for n in evaluate(REPO / "launch" / "vla_policy.launch.py", monkeypatch).nodes)


def test_bringup_wires_planner_to_policy_in_one_namespace(monkeypatch):
    run = evaluate(REPO / "launch" / "vla_bringup.launch.py", monkeypatch, namespace="left", sim="true")
    nodes = {n.kwargs["executable"]: n for n in run.nodes}
    assert set(nodes) == {"planner_node", "policy_node", "sim_node"}
    assert {run.value(n.kwargs["namespace"]) for n in nodes.values()} == {"left"}
    # the planner publishes `instruction` and the policy reads `instruction`, both unremapped (relative)
    assert not nodes["planner_node"].kwargs.get("remappings")
    assert "instruction" not in dict(run.value(nodes["policy_node"].kwargs["remappings"]))
    # the simulator's task instruction is the planner's goal, its actions come from the policy
    assert dict(run.value(nodes["sim_node"].kwargs["remappings"])) == {"instruction": "goal", "action": "vla_policy/action"}
    assert {n.kwargs["executable"] for n in evaluate(REPO / "launch" / "vla_bringup.launch.py", monkeypatch).nodes} == {
        "planner_node", "policy_node"}  # sim:=false (the default)


def policy_parameters(run) -> dict:
    """The parameters a launch file sets on its policy node itself (its dicts, after the parameter files)."""
    (policy,) = [n for n in run.nodes if n.kwargs["executable"] == "policy_node"]
    return {k: v for entry in policy.kwargs["parameters"] if isinstance(entry, dict) for k, v in entry.items()}


@pytest.mark.parametrize("path, arguments", [("vla_sim.launch.py", {}), ("vla_bringup.launch.py", {"sim": "true"})])
def test_with_the_simulator_as_the_arm_the_policy_reads_its_state(path, arguments, monkeypatch):
    """The sim publishes its proprio state on joint_states; a policy with a proprio projector (the shipped
    demo policy, ``make-tiny --proprio-dim``) fails every step without it, so the sim never steps and
    ``vla_sim.launch.py episodes:=N`` never ends (seen under the real ``ros2 launch``)."""
    run = evaluate(REPO / "launch" / path, monkeypatch, **arguments)
    assert policy_parameters(run).get("use_joint_state") is True
    policy, sim = ([n for n in run.nodes if n.kwargs["executable"] == exe][0] for exe in ("policy_node", "sim_node"))
    assert run.value(policy.kwargs["namespace"]) == run.value(sim.kwargs["namespace"])  # same joint_states topic
    for node in (policy, sim):
        assert "joint_states" not in dict(run.value(node.kwargs.get("remappings") or []))
    # a real robot's bringup leaves it to the parameter file
    assert "use_joint_state" not in policy_parameters(evaluate(REPO / "launch" / "vla_bringup.launch.py", monkeypatch))


def test_launch_arguments_left_empty_leave_the_parameter_files_values(monkeypatch):
    """Later entries of a node's ``parameters`` win: a launch argument with a default of its own overrode the file
    (a params file's ``dry_run: true`` became false). Not given, they set nothing; given, they set their parameter."""
    run = evaluate(REPO / "launch" / "vla_policy.launch.py", monkeypatch)
    assert set(policy_parameters(run)) == {"checkpoint"}
    run = evaluate(REPO / "launch" / "vla_policy.launch.py", monkeypatch, dry_run="true", autostart="false", device="cpu")
    given = policy_parameters(run)
    assert set(given) == {"checkpoint", "dry_run", "autostart", "device"} and run.value(given["device"]) == "cpu"
    assert given["dry_run"].kwargs["value_type"] is bool and run.value(given["dry_run"].args[0]) == "true"
    sim = {n.kwargs["executable"]: n for n in evaluate(REPO / "launch" / "vla_sim.launch.py", monkeypatch).nodes}["sim_node"]
    assert [entry for entry in sim.kwargs["parameters"] if isinstance(entry, dict)] == [{}]  # sim_memory.yaml's task stands
    (planner,) = [n for n in evaluate(REPO / "launch" / "vla_bringup.launch.py", monkeypatch).nodes if n.kwargs["executable"] == "planner_node"]
    assert [set(e) for e in planner.kwargs["parameters"] if isinstance(e, dict)] == [{"model"}]


# ---------------------------------------------------------------------------------------- params YAML
def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("path", sorted((PACKAGE / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_parameter_files_name_only_declared_parameters_with_valid_values(path):
    config = CONFIG_FILES.get(path.name, PolicyNodeConfig)
    data = yaml.safe_load(path.read_text())
    assert list(data) == ["/**"] and list(data["/**"]) == ["ros__parameters"]
    values = flatten(data["/**"]["ros__parameters"])
    names = {spec.name for spec in param_specs(config)}
    assert set(values) <= names, f"{path.name}: unknown parameters {sorted(set(values) - names)}"
    if config is PolicyNodeConfig:
        values.setdefault("checkpoint", "/some/checkpoint")
    if config is PlannerNodeConfig:
        values.setdefault("model", "/some/model")
    config_from_params(config, values)  # types and values validate


def test_param_specs_cover_every_registered_caches_parameters():
    from vla_runtime.kv import CACHES
    import dataclasses

    names = {spec.name for spec in param_specs(PolicyNodeConfig)}
    expected = {"kv.mode"} | {f"kv.{f.name}" for cls in CACHES.values() for f in dataclasses.fields(cls.params_class)}
    assert {"kv.window", "kv.n_sink", "kv.chunk", "kv.max_chunks"} <= expected and expected <= names


def test_optional_sizes_use_zero_for_unset():
    values = {"checkpoint": "x", "kv.mode": "chunked", "kv.max_chunks": 0, "kv.window": 32, "execution_horizon": 0}
    cfg = config_from_params(PolicyNodeConfig, values)
    kv = cfg.session.kv
    assert kv.params.max_chunks is None and kv.params.window == 32 and cfg.session.execution_horizon is None
    with pytest.raises(ValueError, match="`window` \\(32\\) is a parameter of sink_window, chunked, not of mode 'full'"):
        config_from_params(PolicyNodeConfig, {**values, "kv.mode": "full"})
    cfg = config_from_params(PolicyNodeConfig, {"checkpoint": "x", "control_rate_hz": 10})  # an int for a float
    assert cfg.control_rate_hz == 10.0 and isinstance(cfg.control_rate_hz, float)
    with pytest.raises(ValueError, match=r"parameter `action_low\[1\]` is 'a' \(str\); expected float"):
        config_from_params(PolicyNodeConfig, {"checkpoint": "x", "action_low": [1.0, "a"]})


def test_readme_documents_every_policy_parameter():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## ROS 2 node"):]
    missing = [spec.name for spec in param_specs(PolicyNodeConfig) if not spec.name.startswith("kv.") and f"`{spec.name}`" not in section]
    assert not missing, f"README's ROS 2 section lacks {missing}"
