"""Message <-> numpy conversions for the policy and simulator nodes.

Pure functions over message objects: nothing here creates or spins a node, so every pitfall is
testable with plain pytest. Errors are ``ValueError``s that say what was received and what was
expected; the nodes report them on ``/diagnostics`` and keep running.

Image pitfalls handled (``sensor_msgs/Image``):
- ``step`` (bytes per row) may exceed ``width * channels * bytes``: rows are padded.
- ``is_bigendian`` matters for 16-bit encodings only; 8-bit data has no byte order.
- ``data`` must hold exactly ``step * height`` bytes; a mismatch is rejected, not guessed around.
- ``msg.data`` is an ``array.array('B')``: read it with ``np.frombuffer`` and write ``bytes``
  (assigning an ndarray costs ~100x more or raises).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from builtin_interfaces.msg import Time
from geometry_msgs.msg import TwistStamped
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float32MultiArray, MultiArrayDimension

# Action message layout: dim[0] = "horizon" (chunk) when present, last dim = "action".
ACTION_LABEL = "action"
HORIZON_LABEL = "horizon"


@dataclass(frozen=True)
class Encoding:
    """How one ``sensor_msgs`` image encoding stores a pixel."""

    channels: int
    itemsize: int  # bytes per channel value
    rgb_index: tuple[int, ...]  # channel indices that give R, G, B (one index for mono)


ENCODINGS: dict[str, Encoding] = {
    "rgb8": Encoding(3, 1, (0, 1, 2)),
    "bgr8": Encoding(3, 1, (2, 1, 0)),
    "rgba8": Encoding(4, 1, (0, 1, 2)),
    "bgra8": Encoding(4, 1, (2, 1, 0)),
    "mono8": Encoding(1, 1, (0,)),
    "rgb16": Encoding(3, 2, (0, 1, 2)),
    "bgr16": Encoding(3, 2, (2, 1, 0)),
    "rgba16": Encoding(4, 2, (0, 1, 2)),
    "bgra16": Encoding(4, 2, (2, 1, 0)),
    "mono16": Encoding(1, 2, (0,)),
}


def check_image_msg(msg: Image, *, max_pixels: int) -> Encoding:
    """Validate an ``Image``'s header against its data without decoding; return its encoding.

    O(1): safe to call in a subscription callback. Raises ``ValueError`` naming the problem.
    """
    encoding = ENCODINGS.get(msg.encoding)
    if encoding is None:
        raise ValueError(f"unsupported image encoding {msg.encoding!r}; expected one of {', '.join(ENCODINGS)}")
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height < 1 or width < 1:
        raise ValueError(f"image is {width}x{height} (width x height); both must be >= 1")
    if height * width > max_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels; the limit (max_image_pixels) is {max_pixels}")
    row = width * encoding.channels * encoding.itemsize
    if step < row:
        raise ValueError(
            f"step {step} is smaller than one row of {msg.encoding} "
            f"(width {width} x {encoding.channels} channels x {encoding.itemsize} bytes = {row})"
        )
    if len(msg.data) == 0:
        raise ValueError(f"image data is empty; expected step x height = {step * height} bytes")
    if len(msg.data) != step * height:
        raise ValueError(f"image data has {len(msg.data)} bytes; expected step x height = {step} x {height} = {step * height}")
    return encoding


def image_msg_to_array(msg: Image, *, max_pixels: int = 1 << 24) -> np.ndarray:
    """Decode ``sensor_msgs/Image`` to RGB. Returns uint8 [H, W, 3] (a copy, C-contiguous).

    16-bit encodings keep their high byte; ``mono`` is repeated into three channels; alpha is dropped.
    """
    encoding = check_image_msg(msg, max_pixels=max_pixels)
    height, width = int(msg.height), int(msg.width)
    row = width * encoding.channels * encoding.itemsize
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(height, int(msg.step))[:, :row]  # [H, step] -> [H, row]
    if encoding.itemsize == 2:
        dtype = np.dtype(">u2" if msg.is_bigendian else "<u2")
        rows = (np.ascontiguousarray(rows).view(dtype) >> 8).astype(np.uint8)  # [H, W*C]
    pixels = rows.reshape(height, width, encoding.channels)  # [H, W, C]
    index = encoding.rgb_index * 3 if len(encoding.rgb_index) == 1 else encoding.rgb_index
    return np.ascontiguousarray(pixels[:, :, list(index)])  # [H, W, 3]


def compressed_msg_to_array(msg: CompressedImage, *, max_pixels: int = 1 << 24) -> np.ndarray:
    """Decode ``sensor_msgs/CompressedImage`` (JPEG, PNG, ...) to RGB uint8 [H, W, 3].

    ``format`` may be plain (``jpeg``) or image_transport style (``rgb8; jpeg compressed bgr8``);
    the bytes themselves say what they are. ``compressedDepth`` is rejected.
    """
    if "compresseddepth" in msg.format.lower():
        raise ValueError(f"CompressedImage format {msg.format!r} is a depth image; expected a colour JPEG/PNG")
    if len(msg.data) == 0:
        raise ValueError(f"CompressedImage data is empty (format {msg.format!r})")
    try:
        with PILImage.open(io.BytesIO(bytes(msg.data))) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(
                    f"compressed image is {width}x{height} = {width * height} pixels; "
                    f"the limit (max_image_pixels) is {max_pixels}"
                )
            rgb = np.asarray(image.convert("RGB"))  # [H, W, 3]
    except (PILImage.UnidentifiedImageError, PILImage.DecompressionBombError, OSError) as e:
        raise ValueError(f"CompressedImage (format {msg.format!r}, {len(msg.data)} bytes) could not be decoded: {e}") from e
    return np.ascontiguousarray(rgb, dtype=np.uint8)


def array_to_image_msg(image: np.ndarray, *, stamp: Time | None = None, frame_id: str = "") -> Image:
    """uint8 [H, W, 3] RGB -> ``sensor_msgs/Image`` (``rgb8``, unpadded)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] RGB image, got {image.dtype} {tuple(image.shape)}")
    msg = Image()
    if stamp is not None:
        msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(image.shape[0]), int(image.shape[1])
    msg.encoding = "rgb8"
    msg.is_bigendian = 0
    msg.step = 3 * msg.width
    msg.data = np.ascontiguousarray(image).tobytes()
    return msg


def array_to_compressed_msg(image: np.ndarray, *, fmt: str = "jpeg", stamp: Time | None = None, frame_id: str = "") -> CompressedImage:
    """uint8 [H, W, 3] RGB -> ``sensor_msgs/CompressedImage`` (``jpeg`` or ``png``)."""
    if fmt not in ("jpeg", "png"):
        raise ValueError(f"compressed format {fmt!r}; expected 'jpeg' or 'png'")
    buffer = io.BytesIO()
    PILImage.fromarray(image).save(buffer, format=fmt.upper())
    msg = CompressedImage()
    if stamp is not None:
        msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.format = fmt
    msg.data = buffer.getvalue()
    return msg


def joint_state_to_array(msg: JointState, names: Sequence[str] = ()) -> np.ndarray:
    """``sensor_msgs/JointState`` positions -> float32 [len(names)] in ``names`` order.

    Without ``names`` the message order is kept. Missing joints and non-finite values raise.
    """
    positions = list(msg.position)
    if msg.name and len(msg.name) != len(positions):
        raise ValueError(f"joint state has {len(msg.name)} names but {len(positions)} positions")
    if names:
        index = {name: i for i, name in enumerate(msg.name)}
        missing = [name for name in names if name not in index]
        if missing:
            raise ValueError(f"joint state lacks joints {missing}; it has {list(msg.name)}")
        positions = [positions[index[name]] for name in names]
    if not positions:
        raise ValueError("joint state has no positions")
    bad = [i for i, value in enumerate(positions) if not math.isfinite(value)]
    if bad:
        labels = [names[i] if names else (msg.name[i] if msg.name else str(i)) for i in bad]
        raise ValueError(f"joint state has non-finite positions for {labels}")
    return np.asarray(positions, dtype=np.float32)


def array_to_joint_state(state: np.ndarray, names: Sequence[str], *, stamp: Time | None = None) -> JointState:
    """float [N] -> ``sensor_msgs/JointState`` (positions only)."""
    if len(names) != len(state):
        raise ValueError(f"{len(names)} joint names for a state of size {len(state)}")
    msg = JointState()
    if stamp is not None:
        msg.header.stamp = stamp
    msg.name = list(names)
    msg.position = [float(v) for v in state]
    return msg


def actions_to_msg(actions: np.ndarray) -> Float32MultiArray:
    """Actions -> ``std_msgs/Float32MultiArray`` with a labelled layout.

    actions: [action_dim] (one action: layout ``action``) or [horizon, action_dim]
    (a chunk: layout ``horizon`` x ``action``), row-major.
    """
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim not in (1, 2) or actions.size == 0:
        raise ValueError(f"actions must be [action_dim] or [horizon, action_dim], got shape {actions.shape}")
    msg = Float32MultiArray()
    labels = (ACTION_LABEL,) if actions.ndim == 1 else (HORIZON_LABEL, ACTION_LABEL)
    strides = np.cumprod(actions.shape[::-1])[::-1]
    msg.layout.dim = [
        MultiArrayDimension(label=label, size=int(size), stride=int(stride))
        for label, size, stride in zip(labels, actions.shape, strides)
    ]
    msg.layout.data_offset = 0
    msg.data = actions.ravel().tolist()
    return msg


def msg_to_actions(msg: Float32MultiArray) -> np.ndarray:
    """Inverse of ``actions_to_msg``: float32 [action_dim] or [horizon, action_dim]; checks layout and values."""
    data = np.asarray(msg.data, dtype=np.float32)
    dims = list(msg.layout.dim)
    if not dims:  # an unlabelled flat array is one action
        shape: tuple[int, ...] = (data.size,)
    else:
        shape = tuple(int(d.size) for d in dims)
        if dims[-1].label != ACTION_LABEL or len(dims) > 2:
            raise ValueError(f"action layout {[d.label for d in dims]}; expected ['action'] or ['horizon', 'action']")
    if data.size == 0 or int(np.prod(shape)) != data.size or msg.layout.data_offset != 0:
        raise ValueError(f"action message has {data.size} values for layout {shape} (offset {msg.layout.data_offset})")
    if not np.all(np.isfinite(data)):
        raise ValueError("action message contains non-finite values")
    return data.reshape(shape)


def action_to_twist(action: np.ndarray, *, scale: float, stamp: Time, frame_id: str) -> TwistStamped:
    """End-effector delta action [>= 6] -> ``geometry_msgs/TwistStamped``.

    linear = action[0:3] * scale, angular = action[3:6] * scale; with ``scale`` = control rate the
    twist is the velocity that covers one step's delta in one control period.
    """
    if action.shape[-1] < 6:
        raise ValueError(f"a twist needs an action of at least 6 values (xyz, rpy), got {action.shape[-1]}")
    msg = TwistStamped()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    lin, ang = (float(v) * scale for v in action[:3]), (float(v) * scale for v in action[3:6])
    msg.twist.linear.x, msg.twist.linear.y, msg.twist.linear.z = lin
    msg.twist.angular.x, msg.twist.angular.y, msg.twist.angular.z = ang
    return msg


def instruction_text(data: str) -> str:
    """Validate an instruction string (``std_msgs/String.data``); returns it stripped.

    rclpy decodes invalid UTF-8 with replacement characters, so U+FFFD marks bytes that were not UTF-8.
    """
    if "\ufffd" in data:
        raise ValueError(f"instruction is not valid UTF-8 (decoded as {data!r})")
    text = data.strip()
    if not text:
        raise ValueError("instruction is empty; expected a task description such as 'open the drawer'")
    return text


def clip_actions(actions: np.ndarray, low: np.ndarray | None, high: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Clip actions [..., action_dim] to bounds [action_dim]; returns (clipped, number of values changed)."""
    if low is None or high is None:
        return actions, 0
    clipped = np.clip(actions, low, high)
    return clipped, int(np.count_nonzero(clipped != actions))
