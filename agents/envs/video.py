"""Evaluation episodes as video: frames from an episode loop, encoded as MP4.

:class:`EpisodeVideos` is a ``maniskill.FrameRecorder``: handed to
``run_episodes`` it keeps the frames of the first ``episodes`` episodes from
one camera slot (the policy's own view), at most ``max_frames`` each and
downscaled to at most ``size`` pixels a side, so a tenant's quota bounds what
one evaluation stores. :func:`encode_video` turns one episode into MP4 bytes
(H.264 through PyAV, which LeRobot brings), or an animated GIF (Pillow) where
PyAV is missing.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from joynexus.schemas.errors import InvalidSpec

#: Frames per second of the videos (ManiSkill's control frequency is 20 Hz).
FPS = 20


class EpisodeVideos:
    """Frames of episodes 0..``episodes``-1 from ``camera_key`` (``observation.images.<cam>``)."""

    def __init__(self, episodes: int, camera_key: str, *, max_frames: int, size: int = 0) -> None:
        if episodes < 0 or max_frames < 1 or size < 0:
            raise InvalidSpec(
                f"videos: episodes={episodes}, max_frames={max_frames}, size={size} must be >= 0, >= 1, >= 0"
            )
        self.episodes = episodes
        self.key = camera_key
        self.max_frames = max_frames
        self.size = size
        self.frames: dict[int, list[np.ndarray]] = {e: [] for e in range(episodes)}

    def observe(self, episode_ids: Sequence[int], obs: Any, live_N: np.ndarray) -> None:
        imgs = obs.get(self.key) if self.episodes else None
        if imgs is None:
            return
        for i, e in enumerate(episode_ids):
            kept = self.frames.get(e)
            if kept is None or not live_N[i] or len(kept) >= self.max_frames:
                continue
            kept.append(_frame(np.asarray(imgs[i]), self.size))

    def encoded(self) -> list[tuple[str, bytes]]:
        """(file name, bytes) per recorded episode, in episode order."""
        out = []
        for e in sorted(self.frames):
            if self.frames[e]:
                ext, data = encode_video(self.frames[e])
                out.append((f"episode-{e}.{ext}", data))
        return out


def _frame(img_C_H_W: np.ndarray, size: int) -> np.ndarray:
    """uint8 [3, H, W] -> [H', W', 3], even sides (H.264), at most ``size`` a side."""
    img = np.ascontiguousarray(np.asarray(img_C_H_W, dtype=np.uint8).transpose(1, 2, 0))
    h, w = img.shape[:2]
    if size and max(h, w) > size:
        from PIL import Image

        scale = size / max(h, w)
        img = np.asarray(
            Image.fromarray(img).resize((max(2, round(w * scale)), max(2, round(h * scale))))
        )
    h, w = img.shape[:2]
    return np.ascontiguousarray(img[: h - h % 2, : w - w % 2])


def encode_video(frames: Sequence[np.ndarray], fps: int = FPS) -> tuple[str, bytes]:
    """("mp4", bytes) of uint8 [H, W, 3] frames; ("gif", bytes) without PyAV."""
    if not frames:
        raise InvalidSpec("no frames to encode")
    try:
        import av
    except ImportError:
        return "gif", _gif(frames, fps)
    buf = io.BytesIO()
    h, w = frames[0].shape[:2]
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "mp4", buf.getvalue()


def _gif(frames: Sequence[np.ndarray], fps: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    images = [Image.fromarray(f) for f in frames]
    images[0].save(
        buf, format="GIF", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0
    )
    return buf.getvalue()


def decode_frames(data: bytes) -> list[np.ndarray]:
    """The frames of an MP4 or GIF (uint8 [H, W, 3]), for checks and tools."""
    if data[:6] in (b"GIF87a", b"GIF89a"):
        from PIL import Image, ImageSequence

        return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(io.BytesIO(data)))]
    import av

    container = av.open(io.BytesIO(data), mode="r")
    try:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    finally:
        container.close()


__all__ = ["FPS", "EpisodeVideos", "decode_frames", "encode_video"]
