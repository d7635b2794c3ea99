"""ROS 2 nodes for vla-runtime: the lifecycle policy node and the simulator bridge.

Importing the package prepares the process for the pip ROS 2 wheels (see ``_env``): a process
whose ``LD_LIBRARY_PATH`` misses the wheels' libraries is re-executed once, as the wheels' own
bootstrapper does at interpreter start.
"""

from . import _env

_env.ensure()
