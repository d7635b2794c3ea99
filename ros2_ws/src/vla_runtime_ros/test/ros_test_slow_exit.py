"""Imported by a policy node under test (``policy_modules``): makes its process slow to end after the
node stopped, as freeing torch, transformers and the DDS libraries is on a loaded machine (seen
taking over 5 s under ``ros2 launch``, which then escalates its SIGINT to SIGTERM). Never import it
in the test process: its exit would wait too."""

import atexit
import os
import time


def _slow_end() -> None:
    os.write(1, b"slow process end: started\n")  # test_node_process waits for this line
    time.sleep(8.0)


atexit.register(_slow_end)
