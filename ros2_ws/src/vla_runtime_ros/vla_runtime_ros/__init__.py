"""ROS 2 nodes for vla-runtime: the lifecycle policy node, the simulator bridge and the planner.

Importing the package (launch files do) loads neither torch nor rclpy and never re-executes the
process. A node run as a program (``python -m vla_runtime_ros.<node>``, or ``ros2 run`` through
``programs``) first prepares the process for the pip ROS 2 wheels (``_env.ensure``).

``PARENT_AT_START`` is the process that started this one, noted as early as a node process can:
``python -m vla_runtime_ros.<node>`` imports the package before the node's own imports (torch, rclpy,
the runtime; seconds), so ``--exit-with-parent`` can tell that its parent died before the watch began.
"""

import os

PARENT_AT_START = os.getppid()
