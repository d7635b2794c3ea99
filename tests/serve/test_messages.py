"""Message -> Request: the key mapping, the image/state/prompt checks and the limits."""

import numpy as np
import pytest

from vla_runtime.serve.config import BatchConfig, Limits, ObservationKeys, ServeConfig
from vla_runtime.serve.messages import BadRequest, RequestKind, parse_request

KEYS = ObservationKeys()
LIMITS = Limits()


def img(shape=(8, 10, 3), dtype=np.uint8):
    return np.arange(np.prod(shape)).reshape(shape).astype(dtype)


def test_openpi_keys_map_to_the_observation():
    state = np.array([0.5, -1.0], np.float32)
    req = parse_request({"observation/image": img(), "observation/wrist_image": img(seed := (4, 4, 3)),
                         "observation/state": state, "prompt": "pick", "extra/unmapped": 3}, KEYS, LIMITS)  # fmt: skip
    assert req.kind is RequestKind.STEP and req.prompt == "pick" and not req.reset
    np.testing.assert_array_equal(req.observation.images["primary"], img())
    assert req.observation.images["wrist"].shape == seed
    assert req.observation.state.dtype == np.float64
    np.testing.assert_array_equal(req.observation.state, [0.5, -1.0])


def test_custom_mapping_concatenates_state_keys_in_order():
    keys = ObservationKeys(images={"primary": "observation/exterior_image_1_left"}, prompt="task",
                           state=["observation/joint_position", "observation/gripper_position"])  # fmt: skip
    msg = {"observation/exterior_image_1_left": img(), "task": "open",
           "observation/joint_position": np.arange(7.0), "observation/gripper_position": [0.25]}  # fmt: skip
    req = parse_request(msg, keys, LIMITS)
    np.testing.assert_array_equal(req.observation.state, [0, 1, 2, 3, 4, 5, 6, 0.25])
    del msg["observation/gripper_position"]
    with pytest.raises(BadRequest, match=r"lacks \['observation/gripper_position'\]"):
        parse_request(msg, keys, LIMITS)


def test_channels_first_images_are_transposed():
    chw = img((3, 8, 10))
    out = parse_request({"observation/image": chw}, KEYS, LIMITS).observation.images["primary"]
    np.testing.assert_array_equal(out, chw.transpose(1, 2, 0))


def test_reset_alone_and_with_a_step():
    assert parse_request({"reset": True}, KEYS, LIMITS).kind is RequestKind.RESET
    req = parse_request({"reset": True, "prompt": "b", "observation/image": img()}, KEYS, LIMITS)
    assert req.kind is RequestKind.STEP and req.reset and req.prompt == "b"


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ([1, 2], "must be a map"),
        ({"prompt": "x"}, "neither an observation nor a reset"),
        ({"observation/wrist_image": img()}, "policy camera 'observation/image' is missing"),
        ({"observation/image": img(dtype=np.float32)}, "dtype uint8"),
        ({"observation/image": img((8, 10))}, r"RGB image \[H, W, 3\].*got shape \[8, 10\]"),
        ({"observation/image": img((8, 10, 4))}, "got shape"),
        ({"observation/image": img((0, 10, 3))}, "got shape"),
        ({"observation/image": [[1, 2, 3]]}, "numpy uint8 array"),
        ({"observation/image": img(), "prompt": ""}, "non-empty string"),
        ({"observation/image": img(), "prompt": 5}, "non-empty string"),
        ({"observation/image": img(), "prompt": "x" * 3000}, "3000 characters; the limit is 2048"),
        ({"observation/image": img(), "observation/state": np.array([1.0, np.nan])}, "NaN or infinite"),
        ({"observation/image": img(), "observation/state": "1,2"}, "numeric array or list"),
        ({"observation/image": img(), "observation/state": np.zeros(300)}, "300 values; the limit is 256"),
        ({"observation/image": img(), "observation/state": np.array([True])}, "numeric array or list, got ndarray of bool"),
        ({"reset": "yes"}, "true or false"),
    ],
)
def test_bad_messages_say_what_is_wrong(message, match):
    with pytest.raises(BadRequest, match=match):
        parse_request(message, KEYS, LIMITS)


def test_image_pixel_limit():
    with pytest.raises(BadRequest, match=r"80 pixels \(8x10\); the limit is 79"):
        parse_request({"observation/image": img()}, KEYS, Limits(max_image_pixels=79))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="must map the 'primary' camera"):
        ObservationKeys(images={"wrist": "w"})
    with pytest.raises(ValueError, match=r"used twice: \['prompt'\]"):
        ObservationKeys(reset="prompt")
    with pytest.raises(ValueError, match="`max_sessions` must be >= 1, got 0"):
        ServeConfig(max_sessions=0)
    with pytest.raises(ValueError, match="`api_token` must not be empty"):
        ServeConfig(api_token=" ")
    # what a YAML file can hold that the fields' types do not: refused by name, not a TypeError deep inside
    with pytest.raises(ValueError, match="`api_token` must be a string or null, got 123456"):
        ServeConfig(api_token=123456)
    with pytest.raises(ValueError, match="`port` must be an integer, got '8000'"):
        ServeConfig(port="8000")
    with pytest.raises(ValueError, match="`max_image_pixels` must be an integer, got 1.5"):
        Limits(max_image_pixels=1.5)
    # a wait the worker's queue cannot take (``inf`` overflows its timeout): refused before the server starts
    with pytest.raises(ValueError, match="`window_ms` must be a finite number, got inf"):
        BatchConfig(window_ms=float("inf"))
    with pytest.raises(ValueError, match="`rejoin_fraction` must be in 0..10000, got 1e\\+300"):
        BatchConfig(rejoin_fraction=1e300)
    assert ServeConfig(idle_timeout_s=5).idle_timeout_s == 5  # an int for a float is fine
    assert ObservationKeys(state="s").state == ["s"]
