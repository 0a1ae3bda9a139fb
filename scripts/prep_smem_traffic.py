#!/usr/bin/env python3
"""Shared-memory traffic of one phase-1 block (kda_chunk_prep_kernel, one chunk and head),
counted from the access patterns of prep_block (src/layer/kda_chunked_body.cuh), before and
after the diagonal split / vectorisation ("old" = commit efdb538, "new" = the code of the
phase-1 rework, measured 652 -> 556 us on the H200). Session 4 replaced step 5 (the solve) by a
tensor-core form and stored Kb' in fp16: "new"'s steps 3a and 5 no longer describe the current
code (the other steps still do).

For every warp-level shared access the model lists each active lane's byte address and width
and counts wavefronts the usual way: 32 banks of 4 bytes; 4-byte (and narrower) accesses are
served for all 32 lanes at once, 8-byte ones per half-warp, 16-byte ones per quarter-warp;
within a phase, the wavefronts are the largest number of distinct 4-byte words that fall in
one bank (lanes reading the same word share it). A warp whose lanes all read the same
address costs one wavefront. ldmatrix x4 is 4 wavefronts (its 8-row groups use distinct
banks with the 272-byte pitch). The instruction widths are those of the PTX (nvcc 13.0,
-O3): e.g. the old solve's float4 loads of A compile to scalar ld.shared.f32
(--new-scalar-solve counts the new code with that solve).

Usage: scripts/prep_smem_traffic.py   (prints a table per step)
"""
from collections import Counter, defaultdict

C, K, SUB = 64, 128, 16
PB = 272                       # bf16 row pitch (bytes)
PG = (K + 4) * 4               # G row pitch (bytes)
Q0 = 0
K0 = Q0 + C * PB
G0 = K0 + C * PB
A0 = G0 + C * PG
T0 = A0 + C * C * 4            # tmp
RQ0, RK0 = T0 + 96 * PB, T0 + 96 * PB + 256
BETA0 = RK0 + 256


def g_col(c, swz):
    return c ^ ((c >> 3) & 4) if swz else c


def wavefronts(lanes):
    """lanes: list of (addr, width) for active lanes (None = inactive)."""
    act = [x for x in lanes if x is not None]
    if not act:
        return 0
    if len({a for a, _ in act}) == 1:
        return 1
    width = max(w for _, w in act)
    per = 32 if width <= 4 else (16 if width == 8 else 8)
    total = 0
    for p0 in range(0, 32, per):
        banks = defaultdict(set)
        for x in lanes[p0:p0 + per]:
            if x is None:
                continue
            a, w = x
            for word in range(a // 4, (a + max(w, 1) - 1) // 4 + 1):
                banks[word % 32].add(word)
        if banks:
            total += max(len(s) for s in banks.values())
    return total


class Tally:
    def __init__(self):
        self.instr = Counter()
        self.wave = Counter()

    def warp(self, step, lanes):
        if all(x is None for x in lanes):
            return
        self.instr[step] += 1
        self.wave[step] += wavefronts(lanes)

    def ldsm(self, step, n):
        self.instr[step] += n
        self.wave[step] += 4 * n


def per_thread_loop(t, step, items, body):
    """items: number of items; thread tid takes items tid, tid + 256, ...; body(item) returns a
    list of accesses (addr, width) in program order (the same count for every item of one
    kind: the lanes of a warp issue them together)."""
    for w in range(8):
        for n in range((items + 255) // 256):
            lane_acc = []
            for lane in range(32):
                it = 256 * n + 32 * w + lane
                lane_acc.append(body(it) if it < items else None)
            nacc = max(len(a) for a in lane_acc if a is not None) if any(a is not None for a in lane_acc) else 0
            for k in range(nacc):
                t.warp(step, [a[k] if a is not None and k < len(a) else None for a in lane_acc])


def count(new):
    t = Tally()
    swz = new
    # Step 1: stores of q, k (8 B), G (16 B); rq, rk, beta; A zero fill.
    def s1(tid):
        row, part = tid >> 2, tid & 3
        acc = []
        for jj in range(8):
            c = (4 * part + 16 * jj) if new else (32 * part + 4 * jj)
            acc += [(Q0 + row * PB + 2 * c, 8), (K0 + row * PB + 2 * c, 8),
                    (G0 + row * PG + 4 * g_col(c, swz), 16)]
        return acc
    per_thread_loop(t, "1 load", 256, s1)
    per_thread_loop(t, "1 load", 64 * 3, lambda e: [(RQ0 + 4 * (e % 64), 4)])
    per_thread_loop(t, "1 load", 1024, lambda e: [(A0 + 16 * e, 16)])
    # Step 2: cumulative sums (threads < 128), 64 x (load, store).
    per_thread_loop(t, "2 cumsum", 128, lambda c: sum(
        [[(G0 + i * PG + 4 * g_col(c, swz), 4)] * 2 for i in range(C)], []))
    # Step 3a: Qt, Kb', gamma.
    if not new:
        def s3a(e):
            i, c = e // 64, 2 * (e % 64)
            return [(Q0 + i * PB + 2 * c, 2), (Q0 + i * PB + 2 * c + 2, 2), (RQ0 + 4 * i, 4),
                    (BETA0 + 4 * i, 4), (RK0 + 4 * i, 4), (K0 + i * PB + 2 * c, 2),
                    (K0 + i * PB + 2 * c + 2, 2), (G0 + i * PG + 4 * c, 8),
                    (G0 + 63 * PG + 4 * c, 8)]
        per_thread_loop(t, "3a Qt Kb'", 4096, s3a)
    else:
        def s3a(e):
            tp, ch = e // 16, e % 16
            acc = [(G0 + 63 * PG + 4 * g_col(8 * ch, swz), 16), (G0 + 63 * PG + 4 * g_col(8 * ch + 4, swz), 16)]
            for h in range(2):
                i = 2 * tp + h
                acc += [(Q0 + i * PB + 16 * ch, 16), (K0 + i * PB + 16 * ch, 16),
                        (G0 + i * PG + 4 * g_col(8 * ch, swz), 16), (G0 + i * PG + 4 * g_col(8 * ch + 4, swz), 16),
                        (RQ0 + 4 * i, 4), (BETA0 + 4 * i, 4), (RK0 + 4 * i, 4)]
            return acc
        per_thread_loop(t, "3a Qt Kb'", 512, s3a)
    per_thread_loop(t, "3a Qt Kb'", 128, lambda c: [(G0 + 63 * PG + 4 * g_col(c, swz), 4)])

    # Step 3b: diagonal blocks.
    def tri_decode(l):
        il = 0
        while (il + 1) * (il + 2) // 2 <= l:
            il += 1
        return il, l - il * (il + 1) // 2
    if not new:
        def s3b(item):
            pair, par = item >> 1, item & 1
            blk, l = pair // 136, pair % 136
            il, jl = tri_decode(l)
            i, j = 16 * blk + il, 16 * blk + jl
            acc = []
            for cc in range(64):
                c = 2 * cc + par
                acc += [(K0 + j * PB + 2 * c, 2), (G0 + i * PG + 4 * c, 4), (G0 + j * PG + 4 * c, 4),
                        (K0 + i * PB + 2 * c, 2), (Q0 + i * PB + 2 * c, 2)]
            return acc
        per_thread_loop(t, "3b diagonal", 1088, s3b)
        # epilogue (parity 0 lanes): beta, rk x2, rq, A store
        def s3b_epi(item):
            pair = item >> 1
            blk, l = pair // 136, pair % 136
            il, jl = tri_decode(l)
            i, j = 16 * blk + il, 16 * blk + jl
            if item & 1:
                return [None] * 0
            return [(BETA0 + 4 * j, 4), (RK0 + 4 * j, 4), (RK0 + 4 * i, 4), (RQ0 + 4 * i, 4), (A0 + 256 * i + 4 * j, 4)]
        per_thread_loop(t, "3b diagonal", 1088, s3b_epi)
    else:
        def scaled(row, r, ch, below, dst_k, dst_q):
            acc = [(G0 + row * PG + 4 * g_col(8 * ch, swz), 16), (G0 + row * PG + 4 * g_col(8 * ch + 4, swz), 16),
                   (G0 + r * PG + 4 * g_col(8 * ch, swz), 16), (G0 + r * PG + 4 * g_col(8 * ch + 4, swz), 16),
                   (K0 + row * PB + 16 * ch, 16), (RK0 + 4 * row, 4), (dst_k + 16 * ch, 16)]
            if below:
                acc += [(Q0 + row * PB + 16 * ch, 16), (RQ0 + 4 * row, 4), (dst_q + 16 * ch, 16)]
            return acc
        def quad(e):
            ch, s, b = e % 16, (e // 16) % 16, e // 256
            r = 16 * b + 7
            base = T0 + 24 * b * PB
            if s < 8:
                return scaled(r + 1 + s, r, ch, True, base + s * PB, base + (8 + s) * PB)
            return scaled(r + 1 - 16 + s, r, ch, False, base + (8 + s) * PB, None)
        per_thread_loop(t, "3b diagonal", 1024, quad)
        t.ldsm("3b diagonal", 4 * 12)
        for w in range(4):   # quadrant epilogue: beta x2, A x2 (per lane)
            for k in range(4):
                lanes = []
                for lane in range(32):
                    g, tt = lane >> 2, lane & 3
                    i, j = 16 * w + 8 + g, 16 * w + 2 * tt
                    lanes.append([(BETA0 + 4 * j, 4), (BETA0 + 4 * j + 4, 4), (A0 + 256 * i + 4 * j, 4),
                                  (A0 + 256 * i + 4 * j + 4, 4)][k])
                t.warp("3b diagonal", lanes)
        def tri(item):
            pair, cg = item >> 3, item & 7
            tri_, l = pair // 36, pair % 36
            il, jl = tri_decode(l)
            i, j = 8 * tri_ + il, 8 * tri_ + jl
            acc = []
            for u in range(2):
                ch = cg + 8 * u
                acc += [(K0 + i * PB + 16 * ch, 16), (Q0 + i * PB + 16 * ch, 16), (K0 + j * PB + 16 * ch, 16),
                        (G0 + i * PG + 4 * g_col(8 * ch, swz), 16), (G0 + i * PG + 4 * g_col(8 * ch + 4, swz), 16),
                        (G0 + j * PG + 4 * g_col(8 * ch, swz), 16), (G0 + j * PG + 4 * g_col(8 * ch + 4, swz), 16)]
            return acc
        per_thread_loop(t, "3b diagonal", 2304, tri)
        def tri_epi(item):
            pair, cg = item >> 3, item & 7
            tri_, l = pair // 36, pair % 36
            il, jl = tri_decode(l)
            i, j = 8 * tri_ + il, 8 * tri_ + jl
            if cg:
                return []
            return [(BETA0 + 4 * j, 4), (RK0 + 4 * j, 4), (RK0 + 4 * i, 4), (RQ0 + 4 * i, 4), (A0 + 256 * i + 4 * j, 4)]
        per_thread_loop(t, "3b diagonal", 2304, tri_epi)

    # Step 4: off-diagonal blocks.
    for I in range(1, 4):
        r = 16 * I - 1
        if not new:
            def ke(e):
                il, c = e // 64, 2 * (e % 64)
                i = 16 * I + il
                return [(G0 + i * PG + 4 * c, 8), (G0 + r * PG + 4 * c, 8), (RK0 + 4 * i, 4), (RQ0 + 4 * i, 4),
                        (K0 + i * PB + 2 * c, 2), (K0 + i * PB + 2 * c + 2, 2), (Q0 + i * PB + 2 * c, 2),
                        (Q0 + i * PB + 2 * c + 2, 2), (T0 + il * PB + 2 * c, 4), (T0 + (16 + il) * PB + 2 * c, 4)]
            per_thread_loop(t, "4 off-diagonal", 1024, ke)
            def kf(e):
                j, c = e // 64, 2 * (e % 64)
                return [(RK0 + 4 * j, 4), (G0 + r * PG + 4 * c, 8), (G0 + j * PG + 4 * c, 8),
                        (K0 + j * PB + 2 * c, 2), (K0 + j * PB + 2 * c + 2, 2), (T0 + (32 + j) * PB + 2 * c, 4)]
            per_thread_loop(t, "4 off-diagonal", 1024 * I, kf)
        else:
            def ke(e):
                il, ch = e // 16, e % 16
                return scaled(16 * I + il, r, ch, True, T0 + il * PB, T0 + (16 + il) * PB)
            per_thread_loop(t, "4 off-diagonal", 256, ke)
            def kf(e):
                j, ch = e // 16, e % 16
                return scaled(j, r, ch, False, T0 + (32 + j) * PB, None)
            per_thread_loop(t, "4 off-diagonal", 256 * I, kf)
        t.ldsm("4 off-diagonal", 24 * I)
        for w in range(I):   # epilogue: beta x2, A x2 per (nt, h)
            for nt in range(2):
                for h in range(2):
                    for k in range(4):
                        lanes = []
                        for lane in range(32):
                            g, tt = lane >> 2, lane & 3
                            i, j = 16 * I + g + 8 * h, 16 * w + 8 * nt + 2 * tt
                            lanes.append([(BETA0 + 4 * j, 4), (BETA0 + 4 * j + 4, 4), (A0 + 256 * i + 4 * j, 4),
                                          (A0 + 256 * i + 4 * j + 4, 4)][k])
                        t.warp("4 off-diagonal", lanes)

    # Step 5: right-hand sides (threads < 128: k, rk, G per row) and the solve.
    vec = new and new_solve_vec[0]
    def rhs(col):
        acc = []
        for i in range(C):
            if not vec:
                acc.append((RK0 + 4 * i, 4))
            elif i % 4 == 0:
                acc.append((RK0 + 4 * i, 16))
            acc += [(K0 + i * PB + 2 * col, 2), (G0 + i * PG + 4 * g_col(col, swz), 4)]
        return acc
    per_thread_loop(t, "5 solve", 128, rhs)
    solve = []
    for i in range(1, C):
        for j0 in range(0, i, 4):
            if vec:
                solve.append((A0 + 256 * i + 4 * j0, 16))
            else:
                for jj in range(j0, min(j0 + 4, i)):
                    solve.append((A0 + 256 * i + 4 * jj, 4))
    per_thread_loop(t, "5 solve", 256, lambda col: solve)
    return t


new_solve_vec = [True]

if __name__ == "__main__":
    import sys
    if "--new-scalar-solve" in sys.argv:
        new_solve_vec[0] = False
    old, new = count(False), count(True)
    steps = sorted(set(old.instr) | set(new.instr))
    print("| step | shared instr. before | wavefronts before | shared instr. after | wavefronts after |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in steps:
        print(f"| {s} | {old.instr[s]} | {old.wave[s]} | {new.instr[s]} | {new.wave[s]} |")
    print(f"| total | {sum(old.instr.values())} | {sum(old.wave.values())} | "
          f"{sum(new.instr.values())} | {sum(new.wave.values())} |")
