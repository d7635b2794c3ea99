"""ament_python package: ``colcon build`` on a ROS 2 machine, ``pip install -e .`` in the project venv."""

from glob import glob

from setuptools import find_packages, setup

package_name = "vla_runtime_ros"

setup(
    name=package_name,
    version="0.1.0",
    packages=find_packages(exclude=["test"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + package_name]),
        ("share/" + package_name, ["package.xml"]),
        # launch/ is a link to the repository's top-level launch/ directory
        ("share/" + package_name + "/launch", sorted(glob("launch/*.launch.py"))),
        ("share/" + package_name + "/config", sorted(glob("config/*.yaml") + glob("config/*.xml"))),
    ],
    install_requires=["setuptools"],
    zip_safe=True,
    maintainer="vla-runtime maintainers",
    maintainer_email="vla-runtime@example.com",
    description="ROS 2 lifecycle policy node and simulator bridge for vla-runtime",
    license="Apache-2.0",
    tests_require=["pytest"],
    entry_points={
        "console_scripts": [
            "policy_node = vla_runtime_ros.programs:policy_node",
            "sim_node = vla_runtime_ros.programs:sim_node",
            "planner_node = vla_runtime_ros.programs:planner_node",
        ],
    },
)
