"""Image mode: three shaded views of a part (front, top, isometric) as one grayscale PNG.

A small numpy z-buffer rasterizer over the part's binary STL (the mesh the warm interpreter
exported), run on the host: orthographic projection, each triangle shaded by the angle of its
normal to the view direction (back faces culled), a shared scale so the views compare. No VTK,
no GL, the same on every machine; a Python loop over triangles, so about a second for a
5,000-triangle flange on this loaded 2-core box. The STL comes from the sandbox, so
it is parsed defensively (size checked against the triangle count, capped).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

VIEW_PX = 160
MAX_TRIANGLES = 200_000
# Each view: rows of the rotation taking world coordinates to (screen x, screen y, depth toward the viewer).
_ISO = np.array([[-1, 1, 0], [-1, -1, 2], [1, 1, 1]], float) / np.array([[2**0.5], [6**0.5], [3**0.5]])
VIEWS = {
    "front (X right, Z up)": np.array([[1, 0, 0], [0, 0, 1], [0, -1, 0]], float),
    "top (X right, Y up)": np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], float),
    "isometric": _ISO,
}


def triangles_from_stl(data: bytes) -> np.ndarray:
    """[T, 3, 3] float64 vertices of a binary STL. Raises ``ValueError`` on a malformed file."""
    if len(data) < 84:
        raise ValueError("not a binary STL: shorter than its header")
    (count,) = struct.unpack_from("<I", data, 80)
    if count > MAX_TRIANGLES or len(data) != 84 + 50 * count:
        raise ValueError(f"not a binary STL of at most {MAX_TRIANGLES} triangles ({count} declared, {len(data)} bytes)")
    records = np.frombuffer(data, dtype=np.dtype([("n", "<f4", 3), ("v", "<f4", (3, 3)), ("a", "<u2")]),
                            count=count, offset=84)
    return records["v"].astype(np.float64)


def _rasterize(tri_2d: np.ndarray, depth: np.ndarray, shade: np.ndarray, px: int) -> np.ndarray:
    """Gray levels of one view: tri_2d [T, 3, 2] in pixel units, depth [T, 3], shade [T] in [0, 1]."""
    zbuf = np.full((px, px), -np.inf)
    image = np.full((px, px), 255, np.uint8)
    for (a, b, c), (za, zb, zc), s in zip(tri_2d, depth, shade):
        x0, y0 = np.floor(np.minimum(np.minimum(a, b), c)).astype(int).clip(0, px - 1)
        x1, y1 = np.ceil(np.maximum(np.maximum(a, b), c)).astype(int).clip(0, px - 1)
        area = (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])
        if abs(area) < 1e-12:
            continue
        ys, xs = np.mgrid[y0 : y1 + 1, x0 : x1 + 1] + 0.5
        w1 = ((c[0] - a[0]) * (ys - a[1]) - (c[1] - a[1]) * (xs - a[0])) / -area
        w2 = ((b[0] - a[0]) * (ys - a[1]) - (b[1] - a[1]) * (xs - a[0])) / area
        w0 = 1 - w1 - w2
        inside = (w0 >= 0) & (w1 >= 0) & (w2 >= 0)
        z = w0 * za + w1 * zb + w2 * zc
        region = zbuf[y0 : y1 + 1, x0 : x1 + 1]
        nearer = inside & (z > region)
        region[nearer] = z[nearer]
        image[y0 : y1 + 1, x0 : x1 + 1][nearer] = int(40 + 180 * s)
    return image[::-1]  # screen y up


def render_views(triangles: np.ndarray, px: int = VIEW_PX) -> np.ndarray:
    """[px, 3 * px] uint8: the VIEWS side by side, one scale for all, white background."""
    centre = (triangles.reshape(-1, 3).min(0) + triangles.reshape(-1, 3).max(0)) / 2
    pts = triangles - centre
    radius = max(float(np.linalg.norm(pts.reshape(-1, 3), axis=1).max()), 1e-9)
    normals = np.cross(pts[:, 1] - pts[:, 0], pts[:, 2] - pts[:, 0])
    normals /= np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-12)
    views = []
    for rotation in VIEWS.values():
        screen = pts @ rotation.T  # [T, 3, 3]
        facing = normals @ rotation[2]
        front = facing > 0  # a closed part's triangles facing away are hidden anyway
        tri_2d = (screen[front][..., :2] / radius * 0.48 + 0.5) * px
        views.append(_rasterize(tri_2d, screen[front][..., 2], facing[front], px))
    return np.concatenate(views, axis=1)


def png(gray: np.ndarray) -> bytes:
    """A grayscale 8-bit PNG of ``gray`` [H, W] (stdlib zlib; no imaging library)."""
    h, w = gray.shape
    raw = b"".join(b"\x00" + gray[row].tobytes() for row in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
