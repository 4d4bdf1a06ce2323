"""The policy gateway's pure parts: openpi's msgpack-numpy frames decoded with bounds,
openpi's observation keys mapped to a policy's inputs, and the API key format."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from joynexus.agents.gateway import codec
from joynexus.agents.gateway.observation import PolicyView
from joynexus.schemas.apikeys import hash_matches, new_key, parse_key
from joynexus.schemas.errors import InvalidMessage, ShapeMismatch
from joynexus.schemas.inference import FeatureSchemaSpec, PolicyRecord


def pack(obj: object) -> bytes:
    """As openpi_client.msgpack_numpy.packb does (arrays as byte-keyed maps)."""

    def default(x: object) -> object:
        raise TypeError(type(x))

    def conv(x: object) -> object:
        if isinstance(x, np.ndarray):
            return codec.pack_array(x)
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return msgspec.msgpack.encode(conv(obj), enc_hook=default)


def view(cams: tuple[str, ...] = ("base_camera",)) -> PolicyView:
    fs = FeatureSchemaSpec(camera_slots=list(cams), image_hw=[64, 64], state_dim=12,
                           action_dim=4, action_horizon=2, base_model="m", state_keys=["qpos"])
    rec = PolicyRecord(tenant_id="acme", workload="pick", version=3, head_type="oft_mlp",
                       head_config={}, schema_signature="sig", feature_schema=fs,
                       base_model="m", object_name="o")
    return PolicyView("acme", "pick", rec, None, "pick the cube")


def test_arrays_round_trip_and_metadata_names_the_policy() -> None:
    img = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    obs = codec.decode_observation(pack({"observation/image": img,
                                         "observation/state": np.ones(12, np.float32),
                                         "prompt": "go", "extra": 1}))
    images, state, prompt = view().inputs(obs)
    assert images["base_camera"].shape == (1, 3, 64, 64)
    assert np.array_equal(images["base_camera"][0], img.transpose(2, 0, 1))
    assert state.shape == (1, 12) and state.dtype == np.float32 and prompt == "go"
    meta = view().metadata()
    assert (meta["action_horizon"], meta["action_dim"], meta["version"]) == (2, 4, 3)
    assert meta["cameras"] == ["base_camera"] and meta["image_size"] == [64, 64]
    # openpi's ALOHA layout: a nested images map, CHW, and no prompt (the workload's)
    obs = codec.decode_observation(pack({"images": {"base_camera": img.transpose(2, 0, 1)},
                                         "state": np.zeros((1, 12))}))
    assert view().inputs(obs)[2] == "pick the cube"


@pytest.mark.parametrize("bad", [
    b"\xc1",                                   # not msgpack
    b"\xdd\xff\xff\xff\xff\xc0",               # an array declaring 4G items
    b"\xc6\xff\xff\xff\xffab",                 # a bin declaring 4 GB
    b"\x91" * 100_000 + b"\xc0",               # 100k nested arrays
    b"\x81\xa1a" + b"\x81\xa1a" * 20 + b"\xc0", # 21 nested maps
    b"\x93\x01\x02\x03",                       # not a map
])
def test_bombs_and_garbage_are_refused_cheaply(bad: bytes) -> None:
    with pytest.raises(InvalidMessage):
        codec.decode_observation(bad)


def test_arrays_must_declare_what_they_carry() -> None:
    good = codec.pack_array(np.zeros(3, np.float32))
    for patch in ({b"dtype": "|O"}, {b"dtype": ">f4"}, {b"shape": [4]}, {b"shape": [-1]},
                  {b"shape": [1] * 9}, {b"data": "text"}):
        with pytest.raises(InvalidMessage):
            codec.decode_observation(msgspec.msgpack.encode({"state": {**good, **patch}}))


def test_mis_shaped_and_non_finite_observations_name_the_problem() -> None:
    img = np.zeros((64, 64, 3), np.uint8)
    v = view()
    cases = [
        ({"image": np.zeros((32, 32, 3), np.uint8), "state": np.zeros(12)}, ShapeMismatch, "64, 64, 3"),
        ({"image": img.astype(np.float32), "state": np.zeros(12)}, InvalidMessage, "uint8"),
        ({"image": img, "state": np.zeros(9)}, ShapeMismatch, r"expected \[12\]"),
        ({"image": img, "state": np.full(12, np.nan)}, InvalidMessage, "NaN"),
        ({"image": img, "state": np.full(12, np.inf, np.float32)}, InvalidMessage, "NaN or inf"),
        ({"state": np.zeros(12)}, InvalidMessage, "no image for camera 'base_camera'"),
        ({"image": img}, InvalidMessage, "no state"),
        ({"image": img, "state": np.zeros(12), "prompt": 7}, InvalidMessage, "prompt"),
    ]
    for obs, err, match in cases:
        with pytest.raises(err, match=match):
            v.inputs(codec.decode_observation(pack(obs)))
    # two cameras: openpi's "image" is the first one only; the second is still missing
    with pytest.raises(InvalidMessage, match="no image for camera 'b'"):
        view(("a", "b")).inputs({"image": img, "state": np.zeros(12)})


def test_keys_are_stored_as_hashes_and_parsed_strictly() -> None:
    key_id, key, digest = new_key()
    assert key.startswith("jnxk_" + key_id) and digest not in key and len(digest) == 64
    parsed = parse_key(key)
    assert parsed is not None and parsed[0] == key_id and hash_matches(digest, parsed[1])
    assert not hash_matches(digest, parse_key(new_key()[1])[1])  # type: ignore[index]
    for bad in ("", "jnxk_", key + "x", key.replace("jnxk_", "jnx_"), "Bearer " + key):
        assert parse_key(bad) is None


def test_openpis_libero_keys_name_the_main_and_the_wrist_camera() -> None:
    # openpi's LIBERO example: observation/image (third person), observation/wrist_image
    agent = np.full((64, 64, 3), 7, np.uint8)
    wrist = np.full((64, 64, 3), 9, np.uint8)
    libero = view(("agentview", "eye_in_hand"))
    assert (libero.main_camera, libero.wrist_camera) == ("agentview", "eye_in_hand")
    obs = codec.decode_observation(pack({"observation/image": agent,
                                         "observation/wrist_image": wrist,
                                         "observation/state": np.ones(12, np.float32)}))
    images, _, _ = libero.inputs(obs)
    assert images["agentview"].max() == 7 and images["eye_in_hand"].max() == 9
    assert "observation/wrist_image" in libero.metadata()["image_keys"]["eye_in_hand"]
    # the wrist first: observation/image still names the other camera
    flipped = view(("wrist", "front")).inputs(obs)[0]
    assert flipped["front"].max() == 7 and flipped["wrist"].max() == 9
    # no wrist camera among two: only the first is openpi's image; the second is missing
    with pytest.raises(InvalidMessage, match="'side'"):
        view(("front", "side")).inputs(obs)
    # two wrist cameras: wrist_image is ambiguous, so it names neither
    assert view(("left_wrist", "right_wrist")).wrist_camera is None
