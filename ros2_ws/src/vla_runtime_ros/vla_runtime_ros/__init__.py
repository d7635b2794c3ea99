"""ROS 2 nodes for vla-runtime: the lifecycle policy node and the simulator bridge.

Importing the package prepares the process for the pip ROS 2 wheels (see ``_env``): a process
whose ``LD_LIBRARY_PATH`` misses the wheels' libraries is re-executed once, as the wheels' own
bootstrapper does at interpreter start.

It also notes the process that started this one (``PARENT_AT_START``) as early as a node process can:
``python -m vla_runtime_ros.<node>`` imports the package before the node's own imports (torch, rclpy,
the runtime; seconds), so ``--exit-with-parent`` can tell that its parent died before the watch began.
"""

import os

PARENT_AT_START = os.getppid()

from . import _env  # noqa: E402 - after PARENT_AT_START: ensure() may re-execute (same pid and parent)

_env.ensure()
