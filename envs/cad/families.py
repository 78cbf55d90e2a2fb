"""Part families of the CAD tasks: a description with dimensions, a reference CadQuery program,
and a plausible-but-wrong program, all drawn from one seeded ``random.Random``.

Each family is a function ``rng -> Part``. Dimensions are whole millimetres (or halves), chosen
so the part is always valid (holes inside the plate, fillets and walls thinner than half the
part). Every wrong program is a mistake a model could plausibly make -- a misread axis, a
forgotten shell, a cut made as a boss, a wrong revolve axis -- and scores well below the
reference (tests/envs/cad/test_tasks.py measures it for every shipped task).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SUFFIX = " Units are millimetres. Assign the final solid to a variable named `result`."


@dataclass(frozen=True, slots=True)
class Part:
    prompt: str
    reference: str
    wrong: str


def _u(rng: random.Random, lo: int, hi: int, step: int = 1) -> int:
    return rng.randrange(lo, hi + 1, step)


def plate_holes(rng: random.Random) -> Part:
    nx, ny = _u(rng, 2, 4), _u(rng, 1, 3)
    d = _u(rng, 6, 12)
    px, py = d + _u(rng, 6, 14), d + _u(rng, 6, 14)
    L, W, T = px * (nx - 1) + d + 2 * _u(rng, 5, 12), py * (ny - 1) + d + 2 * _u(rng, 5, 12), _u(rng, 5, 12)
    prompt = (f"Model a flat rectangular plate {L} long (X), {W} wide (Y) and {T} thick (Z), centred on the "
              f"origin, with a {nx} x {ny} grid of {d} diameter through-holes along Z, spaced {px} in X and "
              f"{py} in Y, the grid centred on the plate.")
    body = ("result = (cq.Workplane('XY').box({L}, {W}, {T})\n"
            "          .faces('>Z').workplane().rarray({px}, {py}, {nx}, {ny}).hole({d}))\n")
    return Part(prompt + SUFFIX, body.format(L=L, W=W, T=T, px=px, py=py, nx=nx, ny=ny, d=d),
                body.format(L=L, W=T, T=W, px=px, py=py, nx=nx, ny=1, d=d))  # width and thickness swapped


def l_bracket(rng: random.Random) -> Part:
    A, H, W, T = _u(rng, 40, 90), _u(rng, 30, 80), _u(rng, 20, 50), _u(rng, 4, 10)
    d = _u(rng, 4, min(10, W // 2))
    prompt = (f"Model an L-shaped bracket of constant thickness {T}, {W} wide along Y: a horizontal base leg "
              f"{A} long along +X lying on the XY plane (from x=0 to x={A}, z=0 to z={T}) and a vertical leg "
              f"rising to z={H} at the x=0 end (from x=0 to x={T}). Drill one {d} diameter through-hole in "
              f"each leg: the base hole along Z at x={(A + T) / 2:g}, the upright hole along X at "
              f"z={(H + T) / 2:g}, both centred in Y (y from 0 to {W}).")
    body = ("profile = [(0, 0), ({A}, 0), ({A}, {T}), ({T}, {T}), ({T}, {H}), (0, {H})]\n"
            "bracket = cq.Workplane('XZ').polyline(profile).close().extrude(-{W})\n"
            "base_hole = cq.Workplane('XY').center({bx}, {W} / 2).circle({d} / 2).extrude({T})\n"
            "wall_hole = cq.Workplane('YZ').center({W} / 2, {hz}).circle({d} / 2).extrude({T})\n"
            "result = bracket.cut(base_hole).cut(wall_hole)\n")
    ref = body.format(A=A, H=H, W=W, T=T, d=d, bx=(A + T) / 2, hz=(H + T) / 2)
    return Part(prompt + SUFFIX, ref,
                body.format(A=H, H=A, W=W, T=T, d=d, bx=(H + T) / 2, hz=(A + T) / 2))  # the legs swapped


def flange(rng: random.Random) -> Part:
    D, T = _u(rng, 60, 120, 2), _u(rng, 6, 14)
    Dh, Hh = _u(rng, 24, D // 2, 2), _u(rng, 6, 20)
    db = _u(rng, 8, Dh - 8, 2)
    n, dbolt = _u(rng, 3, 8), _u(rng, 4, 8)
    pcd = (Dh + D) // 2
    prompt = (f"Model a round flange: a disc of diameter {D} and thickness {T} lying on the XY plane (z=0 to "
              f"z={T}), a coaxial hub of diameter {Dh} rising {Hh} above the disc, a {db} diameter bore "
              f"through the whole part along Z, and {n} bolt holes of diameter {dbolt} through the disc, "
              f"equally spaced on a {pcd} diameter circle, the first on the +X axis.")
    body = ("result = (cq.Workplane('XY').circle({D} / 2).extrude({T})\n"
            "          .faces('>Z').workplane().circle({Dh} / 2).extrude({Hh})\n"
            "          .faces('>Z').workplane().hole({db})\n"
            "          .faces('<Z').workplane().polarArray({pcd} / 2, 0, 360, {n}).hole({dbolt}))\n")
    return Part(prompt + SUFFIX, body.format(D=D, T=T, Dh=Dh, Hh=Hh, db=db, pcd=pcd, n=n, dbolt=dbolt),
                body.format(D=D, T=T, Dh=Dh, Hh=Hh, db=db, pcd=pcd, n=n, dbolt=dbolt)
                .replace(f"circle({D} / 2)", f"circle({D})"))  # the disc's diameter used as its radius


def shelled_box(rng: random.Random) -> Part:
    L, W, H = _u(rng, 30, 90), _u(rng, 30, 90), _u(rng, 20, 60)
    t = _u(rng, 2, 5)
    prompt = (f"Model an open-top box (a tray): outside dimensions {L} (X) x {W} (Y) x {H} (Z), centred on "
              f"the origin, hollowed out with walls and floor {t} thick and the top face (+Z) open.")
    ref = f"result = cq.Workplane('XY').box({L}, {W}, {H}).faces('>Z').shell(-{t})\n"
    return Part(prompt + SUFFIX, ref, f"result = cq.Workplane('XY').box({L}, {W}, {H})\n")  # forgot the shell


def pocket_block(rng: random.Random) -> Part:
    L, W, H = _u(rng, 40, 90), _u(rng, 30, 70), _u(rng, 15, 40)
    r = _u(rng, 2, min(L, W) // 5)
    a, b = _u(rng, 10, L - 16), _u(rng, 10, W - 16)
    depth = _u(rng, 5, H - 5)
    prompt = (f"Model a block {L} (X) x {W} (Y) x {H} (Z), centred on the origin, with its four vertical "
              f"edges rounded to radius {r}, and a rectangular pocket {a} x {b}, {depth} deep, cut into the "
              f"centre of its top (+Z) face.")
    body = ("result = (cq.Workplane('XY').box({L}, {W}, {H}).edges('|Z').fillet({r})\n"
            "          .faces('>Z').workplane().rect({a}, {b}).{op}({depth}))\n")
    values = dict(L=L, W=W, H=H, r=r, a=a, b=b, depth=depth)
    return Part(prompt + SUFFIX, body.format(op="cutBlind", **{**values, "depth": -depth}),
                body.format(op="extrude", **values))  # the pocket made as a boss


def stepped_shaft(rng: random.Random) -> Part:
    r1, r2, r3 = _u(rng, 12, 20), _u(rng, 7, 11), _u(rng, 3, 6)
    l1, l2, l3 = _u(rng, 8, 20), _u(rng, 15, 40), _u(rng, 10, 30)
    L = l1 + l2 + l3
    prompt = (f"Model a stepped shaft, a solid of revolution about the Z axis starting at z=0: diameter "
              f"{2 * r1} for the first {l1}, then diameter {2 * r2} for {l2}, then diameter {2 * r3} for "
              f"{l3} (total length {L}).")
    body = ("profile = [(0, 0), ({r1}, 0), ({r1}, {l1}), ({r2}, {l1}), ({r2}, {l12}), ({r3}, {l12}), "
            "({r3}, {L}), (0, {L})]\n"
            "result = cq.Workplane('XZ').polyline(profile).close().revolve(360, (0, 0, 0), {axis})\n")
    values = dict(r1=r1, r2=r2, r3=r3, l1=l1, l12=l1 + l2, L=L)
    return Part(prompt + SUFFIX, body.format(axis="(0, 1, 0)", **values),
                body.format(axis="(1, 0, 0)", **values))  # revolved about X, not Z


def cbore_plate(rng: random.Random) -> Part:
    W, T = _u(rng, 30, 50), _u(rng, 8, 14)
    L = W + _u(rng, 20, 40)
    d = _u(rng, 5, 8)
    cd, cdepth = d + _u(rng, 4, 8, 2), _u(rng, 3, T // 2)
    m = cd // 2 + _u(rng, 3, 6)
    prompt = (f"Model a plate {L} (X) x {W} (Y) x {T} (Z), centred on the origin, with four counterbored "
              f"through-holes from the top (+Z) face, one near each corner, {m} in from both edges: hole "
              f"diameter {d}, counterbore diameter {cd} and depth {cdepth}.")
    body = ("result = (cq.Workplane('XY').box({L}, {W}, {T})\n"
            "          .faces('>Z').workplane().rect({px}, {py}, forConstruction=True)\n"
            "          .vertices().cboreHole({d}, {cd}, {cdepth}))\n")
    values = dict(T=T, d=d, cd=cd, cdepth=cdepth)
    return Part(prompt + SUFFIX, body.format(L=L, W=W, px=L - 2 * m, py=W - 2 * m, **values),
                body.format(L=W, W=L, px=W - 2 * m, py=L - 2 * m, **values))  # X and Y swapped


def hex_standoff(rng: random.Random) -> Part:
    F = _u(rng, 8, 20)
    H = F * 2 + _u(rng, 5, 30)
    d = _u(rng, 3, F - 4)
    prompt = (f"Model a hexagonal standoff: a hexagonal prism {F} across the flats (two flats parallel to the "
              f"XZ plane), {H} tall along Z from z=0, with a {d} diameter bore through its axis.")
    body = ("result = (cq.Workplane('XY').polygon(6, {F} / math.cos(math.pi / 6)).extrude({H})\n"
            "          .faces('>Z').workplane().hole({d}))\n")
    head = "import math\n"
    return Part(prompt + SUFFIX, head + body.format(F=F, H=H, d=d),
                head + body.format(F=H, H=F, d=d))  # across-flats and height swapped


def block(rng: random.Random) -> Part:
    """Easy (EASY_FAMILIES): one box, its three sizes in the prompt."""
    L, W = _u(rng, 20, 90), _u(rng, 10, 60)
    T = rng.choice([t for t in range(5, 41) if abs(t - W) >= 6])
    prompt = f"Model a rectangular block {L} long (X), {W} wide (Y) and {T} tall (Z), centred on the origin."
    body = "result = cq.Workplane('XY').box({L}, {W}, {T})\n"
    return Part(prompt + SUFFIX, body.format(L=L, W=W, T=T), body.format(L=L, W=T, T=W))  # width and height swapped


def disc(rng: random.Random) -> Part:
    """Easy (EASY_FAMILIES): one cylinder along Z, its diameter and height in the prompt."""
    D = _u(rng, 10, 80, 2)
    H = rng.choice([h for h in range(4, 61) if abs(h - D) >= 8])
    prompt = f"Model a cylinder of diameter {D} and height {H} along Z, centred on the origin."
    body = "result = cq.Workplane('XY').cylinder({H}, {D} / 2)\n"
    return Part(prompt + SUFFIX, body.format(D=D, H=H), body.format(D=H, H=D))  # diameter and height swapped


FAMILIES = (plate_holes, l_bracket, flange, shelled_box, pocket_block, stepped_shaft, cbore_plate, hex_standoff)
# Easier families, not in the shipped set (tasks.py --families): for a model too small to solve the others.
EASY_FAMILIES = (block, disc)
