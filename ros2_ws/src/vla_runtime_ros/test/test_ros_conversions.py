"""Message <-> numpy conversions, without spinning: every sensor_msgs/Image pitfall, compressed frames,
joint states, action layouts, instructions."""

import io
import math

import numpy as np
import pytest

pytest.importorskip("rclpy")

from PIL import Image as PILImage  # noqa: E402
from sensor_msgs.msg import CompressedImage, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray, MultiArrayDimension  # noqa: E402
from ros_messages import raw_image_msg as raw_msg  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)  # odd sizes: no accidental alignment


@pytest.mark.parametrize(
    "encoding, pixels",
    [
        ("rgb8", RGB),
        ("bgr8", RGB[..., ::-1]),
        ("rgba8", np.dstack([RGB, np.full(RGB.shape[:2], 7, np.uint8)])),
        ("bgra8", np.dstack([RGB[..., ::-1], np.full(RGB.shape[:2], 7, np.uint8)])),
    ],
)
@pytest.mark.parametrize("pad", [0, 3])
def test_colour_encodings_decode_to_rgb(encoding, pixels, pad):
    out = conversions.image_msg_to_array(raw_msg(np.ascontiguousarray(pixels), encoding, pad=pad))
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, RGB)


def test_mono8_repeats_into_three_channels():
    gray = RGB[..., 0]
    out = conversions.image_msg_to_array(raw_msg(gray[..., None], "mono8", pad=1))
    np.testing.assert_array_equal(out, np.repeat(gray[..., None], 3, axis=2))


@pytest.mark.parametrize("bigendian", [False, True])
def test_16_bit_encodings_honour_byte_order(bigendian):
    wide = RGB.astype(np.uint16) * 256 + 0x55  # high byte = the 8-bit value, low byte = noise
    out = conversions.image_msg_to_array(raw_msg(wide, "rgb16", pad=2, bigendian=bigendian))
    np.testing.assert_array_equal(out, RGB)
    mono = conversions.image_msg_to_array(raw_msg(wide[..., :1], "mono16", bigendian=bigendian))
    np.testing.assert_array_equal(mono[..., 1], RGB[..., 0])


def test_big_endian_flag_is_read_not_ignored():
    """The same bytes read with the wrong flag give a different image: the flag matters for 16-bit data."""
    wide = RGB.astype(np.uint16) * 256 + 0x55
    msg = raw_msg(wide, "bgr16", bigendian=True)
    msg.is_bigendian = 0
    assert not np.array_equal(conversions.image_msg_to_array(msg), RGB)


def test_eight_bit_data_ignores_the_endianness_flag():
    msg = raw_msg(RGB, "rgb8")
    msg.is_bigendian = 1
    np.testing.assert_array_equal(conversions.image_msg_to_array(msg), RGB)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: setattr(m, "encoding", "yuv422"), "unsupported image encoding 'yuv422'"),
        (lambda m: setattr(m, "encoding", "RGB8"), "unsupported image encoding 'RGB8'"),
        (lambda m: setattr(m, "step", 20), "step 20 is smaller than one row of rgb8 (width 7 x 3 channels x 1 bytes = 21)"),
        (lambda m: setattr(m, "data", bytes(m.data)[:-1]), "image data has 104 bytes; expected step x height = 21 x 5 = 105"),
        (lambda m: setattr(m, "data", bytes(m.data) + b"\0"), "image data has 106 bytes"),
        (lambda m: setattr(m, "data", b""), "image data is empty"),
        (lambda m: setattr(m, "height", 0), "image is 7x0 (width x height)"),
        (lambda m: (setattr(m, "width", 0), setattr(m, "height", 0)), "image is 0x0"),
        (lambda m: (setattr(m, "width", 100_000), setattr(m, "height", 100_000)), "the limit (max_image_pixels) is 1000"),
    ],
    ids=["encoding", "encoding-case", "step-too-small", "data-short", "data-long", "empty", "zero-height", "zero-size", "huge"],
)
def test_bad_images_raise_naming_the_problem(mutate, message):
    msg = raw_msg(RGB, "rgb8")
    mutate(msg)
    with pytest.raises(ValueError) as e:
        conversions.image_msg_to_array(msg, max_pixels=1000)
    assert message in str(e.value)


def test_pixel_limit_applies_to_real_frames():
    msg = conversions.array_to_image_msg(np.zeros((40, 30, 3), np.uint8))
    assert conversions.image_msg_to_array(msg, max_pixels=1200).shape == (40, 30, 3)
    with pytest.raises(ValueError, match="40 = 1200 pixels|30x40 = 1200 pixels"):
        conversions.image_msg_to_array(msg, max_pixels=1199)


def test_array_to_image_round_trip_and_validation():
    msg = conversions.array_to_image_msg(RGB, frame_id="cam")
    assert (msg.height, msg.width, msg.step, msg.encoding, msg.header.frame_id) == (5, 7, 21, "rgb8", "cam")
    np.testing.assert_array_equal(conversions.image_msg_to_array(msg), RGB)
    with pytest.raises(ValueError, match="uint8"):
        conversions.array_to_image_msg(RGB.astype(np.float32))


@pytest.mark.parametrize("fmt", ["png", "rgb8; png compressed bgr8"])
def test_compressed_png_is_lossless(fmt):
    msg = conversions.array_to_compressed_msg(RGB, fmt="png")
    msg.format = fmt
    np.testing.assert_array_equal(conversions.compressed_msg_to_array(msg), RGB)


def test_compressed_jpeg_and_grey_png_decode_to_rgb():
    smooth = np.tile(np.linspace(0, 255, 32, dtype=np.uint8)[None, :, None], (24, 1, 3))
    out = conversions.compressed_msg_to_array(conversions.array_to_compressed_msg(smooth, fmt="jpeg"))
    assert out.shape == (24, 32, 3) and np.abs(out.astype(int) - smooth).max() < 8
    buffer = io.BytesIO()
    PILImage.fromarray(RGB[..., 0]).save(buffer, format="PNG")
    grey = conversions.compressed_msg_to_array(CompressedImage(format="png", data=buffer.getvalue()))
    np.testing.assert_array_equal(grey, np.repeat(RGB[..., :1], 3, axis=2))


@pytest.mark.parametrize(
    "msg, message",
    [
        (CompressedImage(format="jpeg", data=b""), "data is empty"),
        (CompressedImage(format="jpeg", data=b"not a jpeg at all"), "could not be decoded"),
        (CompressedImage(format="16UC1; compressedDepth", data=b"\0" * 20), "depth image"),
    ],
)
def test_bad_compressed_images_raise(msg, message):
    with pytest.raises(ValueError, match=message):
        conversions.compressed_msg_to_array(msg)


def test_compressed_pixel_limit_is_checked_before_decoding():
    msg = conversions.array_to_compressed_msg(np.zeros((64, 64, 3), np.uint8), fmt="png")
    with pytest.raises(ValueError, match="64x64 = 4096 pixels"):
        conversions.compressed_msg_to_array(msg, max_pixels=4095)


def test_joint_state_reorders_by_name_and_rejects_bad_values():
    msg = JointState(name=["b", "a", "c"], position=[2.0, 1.0, 3.0])
    np.testing.assert_array_equal(conversions.joint_state_to_array(msg, ["a", "b"]), [1.0, 2.0])
    np.testing.assert_array_equal(conversions.joint_state_to_array(msg), [2.0, 1.0, 3.0])
    with pytest.raises(ValueError, match=r"lacks joints \['d'\]"):
        conversions.joint_state_to_array(msg, ["a", "d"])
    with pytest.raises(ValueError, match=r"non-finite positions for \['a'\]"):
        conversions.joint_state_to_array(JointState(name=["a", "b"], position=[math.nan, 0.0]), ["b", "a"])
    with pytest.raises(ValueError, match="non-finite"):
        conversions.joint_state_to_array(JointState(position=[0.0, math.inf]))
    with pytest.raises(ValueError, match="2 names but 1 positions"):
        conversions.joint_state_to_array(JointState(name=["a", "b"], position=[0.0]))
    with pytest.raises(ValueError, match="no positions"):
        conversions.joint_state_to_array(JointState())


def test_action_layouts_round_trip():
    one = np.arange(7, dtype=np.float32)
    msg = conversions.actions_to_msg(one)
    assert [(d.label, d.size, d.stride) for d in msg.layout.dim] == [("action", 7, 7)]
    np.testing.assert_array_equal(conversions.msg_to_actions(msg), one)
    chunk = np.arange(28, dtype=np.float32).reshape(4, 7)
    msg = conversions.actions_to_msg(chunk)
    assert [(d.label, d.size, d.stride) for d in msg.layout.dim] == [("horizon", 4, 28), ("action", 7, 7)]
    np.testing.assert_array_equal(conversions.msg_to_actions(msg), chunk)


def test_bad_action_messages_raise():
    flat = Float32MultiArray(data=[0.0, 1.0])
    np.testing.assert_array_equal(conversions.msg_to_actions(flat), [0.0, 1.0])  # unlabelled = one action
    wrong = Float32MultiArray(data=[0.0] * 6)
    wrong.layout.dim = [MultiArrayDimension(label="action", size=7, stride=7)]
    with pytest.raises(ValueError, match="6 values for layout"):
        conversions.msg_to_actions(wrong)
    wrong.layout.dim = [MultiArrayDimension(label="joint", size=6, stride=6)]
    with pytest.raises(ValueError, match="expected \\['action'\\]"):
        conversions.msg_to_actions(wrong)
    with pytest.raises(ValueError, match="non-finite"):
        conversions.msg_to_actions(Float32MultiArray(data=[0.0, math.nan]))
    with pytest.raises(ValueError, match="shape"):
        conversions.actions_to_msg(np.zeros((2, 3, 4)))


def test_twist_scales_the_delta_by_the_rate():
    twist = conversions.action_to_twist(np.array([0.1, -0.2, 0.3, 0.01, 0.02, 0.03, 1.0]), scale=10.0,
                                        stamp=conversions.Time(sec=3), frame_id="tool0")
    assert (twist.twist.linear.x, twist.twist.linear.y, twist.twist.linear.z) == pytest.approx((1.0, -2.0, 3.0))
    assert (twist.twist.angular.x, twist.twist.angular.z) == pytest.approx((0.1, 0.3))
    assert twist.header.frame_id == "tool0" and twist.header.stamp.sec == 3
    with pytest.raises(ValueError, match="at least 6"):
        conversions.action_to_twist(np.zeros(4), scale=1.0, stamp=conversions.Time(), frame_id="")


def test_instruction_validation():
    assert conversions.instruction_text("  open the drawer \n") == "open the drawer"
    with pytest.raises(ValueError, match="empty"):
        conversions.instruction_text(" \t ")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        conversions.instruction_text(b"\xff\xfeopen".decode("utf-8", errors="replace"))


def test_clipping_counts_changed_values():
    actions = np.array([[-2.0, 0.5, 3.0]])
    clipped, n = conversions.clip_actions(actions, np.array([-1.0, -1.0, -1.0]), np.array([1.0, 1.0, 1.0]))
    np.testing.assert_array_equal(clipped, [[-1.0, 0.5, 1.0]])
    assert n == 2
    assert conversions.clip_actions(actions, None, None) == (actions, 0)
