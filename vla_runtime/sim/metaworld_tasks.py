"""The 50 Meta-World v3 tasks and the instruction a language-conditioned policy is given for each.

The instructions are ours (short imperative sentences describing the goal); the task names are
Meta-World's (``metaworld.env_dict.ALL_V3_ENVIRONMENTS``; a test checks the two lists agree).
``METAWORLD_ALL_TASKS`` adds the memory tasks (``memory/``), which run in the same backend.
"""

from __future__ import annotations

from .memory import MEMORY_TASKS

METAWORLD_INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "Put the ring onto the peg",
    "basketball-v3": "Dunk the ball into the basket",
    "bin-picking-v3": "Move the block from one bin into the other bin",
    "box-close-v3": "Put the lid on the box",
    "button-press-topdown-v3": "Press the button from the top",
    "button-press-topdown-wall-v3": "Press the button from the top, reaching past the wall",
    "button-press-v3": "Press the button",
    "button-press-wall-v3": "Press the button behind the wall",
    "coffee-button-v3": "Press the button on the coffee machine",
    "coffee-pull-v3": "Pull the mug out from under the coffee machine",
    "coffee-push-v3": "Push the mug under the coffee machine",
    "dial-turn-v3": "Turn the dial",
    "disassemble-v3": "Take the ring off the peg",
    "door-close-v3": "Close the door",
    "door-lock-v3": "Lock the door by turning the lock",
    "door-open-v3": "Open the door",
    "door-unlock-v3": "Unlock the door by turning the lock",
    "hand-insert-v3": "Put the gripper into the hole",
    "drawer-close-v3": "Close the drawer",
    "drawer-open-v3": "Open the drawer",
    "faucet-open-v3": "Turn the faucet on",
    "faucet-close-v3": "Turn the faucet off",
    "hammer-v3": "Hammer the nail into the wall",
    "handle-press-side-v3": "Press the handle down from the side",
    "handle-press-v3": "Press the handle down",
    "handle-pull-side-v3": "Pull the handle up from the side",
    "handle-pull-v3": "Pull the handle up",
    "lever-pull-v3": "Pull the lever up",
    "pick-place-wall-v3": "Pick up the puck and place it at the goal behind the wall",
    "pick-out-of-hole-v3": "Pick the peg out of the hole",
    "pick-place-v3": "Pick up the puck and place it at the goal",
    "plate-slide-v3": "Slide the plate into the goal",
    "plate-slide-side-v3": "Slide the plate sideways into the goal",
    "plate-slide-back-v3": "Slide the plate back out of the goal",
    "plate-slide-back-side-v3": "Slide the plate sideways back out of the goal",
    "peg-insert-side-v3": "Insert the peg into the hole from the side",
    "peg-unplug-side-v3": "Unplug the peg from the side",
    "soccer-v3": "Kick the ball into the goal",
    "stick-push-v3": "Grasp the stick and push the box with it",
    "stick-pull-v3": "Grasp the stick and pull the box with it",
    "push-v3": "Push the puck to the goal",
    "push-wall-v3": "Push the puck around the wall to the goal",
    "push-back-v3": "Pull the puck back to the goal",
    "reach-v3": "Reach the goal position",
    "reach-wall-v3": "Reach the goal position behind the wall",
    "shelf-place-v3": "Place the block on the shelf",
    "sweep-into-v3": "Sweep the puck into the hole",
    "sweep-v3": "Sweep the puck off the table",
    "window-open-v3": "Slide the window open",
    "window-close-v3": "Slide the window closed",
}

METAWORLD_TASKS: list[str] = list(METAWORLD_INSTRUCTIONS)
#: every task the Meta-World backend runs: Meta-World's 50, then the memory tasks
METAWORLD_ALL_TASKS: list[str] = METAWORLD_TASKS + list(MEMORY_TASKS)
