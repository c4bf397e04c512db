#!/usr/bin/env python3
"""The FP8 ring's consumer alone: today's `mma.sync` diagonal against a `wgmma` one.

    scripts/gpu/f8_probe.py --build OUT.cubin      # here: NVRTC + ptxas for sm_90a (~2 min)
    scripts/gpu/f8_probe.py --selftest             # here: the packing against the PTX layouts
    scripts/gpu/f8_probe.py --cubin OUT.cubin [--iters N]   # on the GPU machine

scripts/gpu/f8_probe.cu's two kernels reduce a 32 KB slot of e4m3 weights, resident in shared
memory, against a batch-1 input, `iters` passes on every SM: "mma" as the FP8 ring does it now
(`ring_f8_dot`: F2FP conversions and m16n8k16 f16 tiles, inputs as f16), "wgmma" with
m64n8k32 e4m3 tiles from shared-memory descriptors (inputs as e4m3: the ring would quantize them
per token). On the device it checks both against numpy (and that the descriptors' strides
swapped give wrong sums), then prints each one's ns a slot on one SM beside what HBM takes to
bring an SM its share of a slot: the consumer is the FP8 ring's limit where its ns exceed
that (docs/cuda.md, "FP8 in the ring"). Needs numpy and the driver's libcuda (not torch).
"""
import argparse
import ctypes
import pathlib
import sys

try:
    import numpy as np
except ImportError:  # (--build needs no numpy)
    np = None

HERE = pathlib.Path(__file__).resolve().parent
SLOT = 32768
SMEM = 2 * SLOT + 4096
# bf16x8_f16's order of 8 inputs in a uint4 (pairs 01, 45, 23, 67): its own inverse, so the
# same list packs them and reads them back.
PAIR_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]


def e4m3_table() -> np.ndarray:
    """The 256 e4m3 values (0x7f and 0xff are NaN)."""
    t = np.zeros(256, np.float64)
    for b in range(256):
        s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        t[b] = np.nan if (b & 0x7F) == 0x7F else (-v if s else v)
    return t


def random_e4m3(rng, n: int) -> np.ndarray:
    """n e4m3 bytes of magnitude at most 2 (exponent <= 7), no NaN."""
    return ((rng.integers(0, 2, n) << 7) | rng.integers(0, 64, n)).astype(np.uint8)


def pack_mma_input(x16: np.ndarray) -> np.ndarray:
    """2 x 1,024 f16 inputs in probe_mma's read order: for half c, pass it, lane l, the 16 inputs
    of k = 16 (32 it + l).. as two uint4 at 128 c + 64 it + l and + 32, each 8 inputs with their
    pairs in PAIR_ORDER."""
    out = np.zeros(2048, np.float16)
    for c in range(2):
        for it in range(2):
            for lane in range(32):
                k = c * 1024 + 16 * (32 * it + lane)
                for h, pos in enumerate((128 * c + 64 * it + lane, 128 * c + 64 * it + 32 + lane)):
                    out[8 * pos : 8 * pos + 8] = x16[k + 8 * h + np.array(PAIR_ORDER)]
    return out


def unpack_mma_input(xh: np.ndarray, c: int, it: int, lane: int) -> np.ndarray:
    """The 16 inputs that lane `lane` pairs with its weights 0..15 in pass `it` of half `c`, as
    the m16n8k16 tiles pair them (PAIR_ORDER read back)."""
    out = []
    for pos in (128 * c + 64 * it + lane, 128 * c + 64 * it + 32 + lane):
        out.extend(xh[8 * pos : 8 * pos + 8][PAIR_ORDER])
    return np.array(out)


def pack_wgmma(w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """64 x 512 weights and 512 inputs (e4m3 bytes) as probe_wgmma's slot and B tiles."""
    slot = np.zeros(SLOT, np.uint8)
    b = np.zeros(4096, np.uint8)
    for t in range(16):
        for mb in range(8):
            for kb in range(2):
                base = 2048 * t + 256 * mb + 128 * kb
                blk = w[8 * mb : 8 * mb + 8, 32 * t + 16 * kb : 32 * t + 16 * kb + 16]
                slot[base : base + 128] = blk.reshape(-1)
        for kb in range(2):
            b[256 * t + 128 * kb : 256 * t + 128 * kb + 16] = x[32 * t + 16 * kb : 32 * t + 16 * kb + 16]
    return slot, b


def emulate_wgmma_col0(slot, b, lbo: int, sbo: int, dec) -> np.ndarray:
    """Column 0 of sum over tiles of A B, reading A and B as the PTX ISA describes no-swizzle
    K-major descriptors: element (row, k) of a tile at (row / 8) sbo + (k / 16) lbo + 16 (row
    % 8) + k % 16 (B's rows being its n)."""
    d = np.zeros(64)
    for t in range(16):
        a0, b0 = 2048 * t, 256 * t
        for r in range(64):
            for k in range(32):
                ai = a0 + (r // 8) * sbo + (k // 16) * lbo + 16 * (r % 8) + k % 16
                bi = b0 + (k // 16) * lbo + k % 16  # (n = 0)
                d[r] += dec[slot[ai]] * dec[b[bi]] if ai < SLOT and bi < 4096 else np.nan
    return d


def selftest() -> None:
    rng = np.random.default_rng(1)
    dec = e4m3_table()
    # mma: every lane's 16 inputs are its 16 weights' own.
    x16 = rng.standard_normal(2048).astype(np.float16)
    xh = pack_mma_input(x16)
    for c in range(2):
        for it in range(2):
            for lane in range(32):
                k = c * 1024 + 16 * (32 * it + lane)
                assert np.array_equal(unpack_mma_input(xh, c, it, lane), x16[k : k + 16]), (c, it, lane)
    # wgmma: the packing read through the PTX layout gives W x; swapped strides do not.
    w = random_e4m3(rng, 64 * 512).reshape(64, 512)
    x = random_e4m3(rng, 512)
    slot, b = pack_wgmma(w, x)
    want = dec[w] @ dec[x]
    got = emulate_wgmma_col0(slot, b, 128, 256, dec)
    assert np.allclose(got, want), "packing vs the descriptor layout"
    bad = emulate_wgmma_col0(slot, b, 256, 128, dec)
    assert not np.allclose(bad, want, equal_nan=False), "swapped strides must differ"
    print("selftest: ok (mma input order; wgmma tiles read through lbo 128 / sbo 256)")


def build(out: str) -> None:
    sys.path.insert(0, str(HERE))
    from kernel_image import build_image  # (NVRTC and ptxas as for the engine's cubins)

    source = (HERE.parents[1] / "kernels" / "cuda" / "harrier.cu").read_bytes() + b"\n" + (HERE / "f8_probe.cu").read_bytes()
    build_image(source, pathlib.Path(out), [], arch="sm_90a")
    print(f"built {out}")


class Cuda:
    """The few driver calls the probe needs (ctypes on libcuda)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ck(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ck(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.ck(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "ctx")
        self.ck(self.lib.cuCtxSetCurrent(self.ctx), "ctx current")
        sms = ctypes.c_int()
        self.ck(self.lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev), "SM count")
        self.sms = sms.value

    @staticmethod
    def ck(rc: int, what: str) -> None:
        if rc != 0:
            sys.exit(f"CUDA error {rc} in {what}")

    def alloc(self, data: np.ndarray | int) -> ctypes.c_uint64:
        n = data if isinstance(data, int) else data.nbytes
        p = ctypes.c_uint64()
        self.ck(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "alloc")
        if not isinstance(data, int):
            arr = np.ascontiguousarray(data)
            self.ck(self.lib.cuMemcpyHtoD_v2(p, arr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n)), "HtoD")
        return p

    def read(self, p, n: int, dtype) -> np.ndarray:
        out = np.zeros(n, dtype)
        self.ck(self.lib.cuMemcpyDtoH_v2(out.ctypes.data_as(ctypes.c_void_p), p, ctypes.c_size_t(out.nbytes)), "DtoH")
        return out

    def timed(self, fn) -> float:
        """ms of fn() between two events."""
        a, b = ctypes.c_void_p(), ctypes.c_void_p()
        self.ck(self.lib.cuEventCreate(ctypes.byref(a), 0), "event")
        self.ck(self.lib.cuEventCreate(ctypes.byref(b), 0), "event")
        self.ck(self.lib.cuEventRecord(a, None), "record")
        fn()
        self.ck(self.lib.cuEventRecord(b, None), "record")
        self.ck(self.lib.cuEventSynchronize(b), "sync")
        ms = ctypes.c_float()
        self.ck(self.lib.cuEventElapsedTime(ctypes.byref(ms), a, b), "elapsed")
        return ms.value


def run(cubin: str, iters: int) -> None:
    cu = Cuda()
    mod = ctypes.c_void_p()
    image = pathlib.Path(cubin).read_bytes()
    cu.ck(cu.lib.cuModuleLoadData(ctypes.byref(mod), image), "module load")
    fns = {}
    for name in ("probe_mma", "probe_wgmma"):
        f = ctypes.c_void_p()
        cu.ck(cu.lib.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        cu.ck(cu.lib.cuFuncSetAttribute(f, 8, SMEM), "smem attribute")  # (MAX_DYNAMIC_SHARED_SIZE_BYTES)
        fns[name] = f
    rng = np.random.default_rng(7)
    dec = e4m3_table()
    blocks = cu.sms

    def launch(name, args):
        holders = [ctypes.c_uint64(a.value) if isinstance(a, ctypes.c_uint64) else ctypes.c_int(a) for a in args]
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        cu.ck(cu.lib.cuLaunchKernel(fns[name], blocks, 1, 1, 512, 1, 1, SMEM, None, ptrs, None), name)

    # mma: 32 units of 1,024 weights, unit u against input half u % 2.
    w = random_e4m3(rng, SLOT)
    x16 = (rng.standard_normal(2048) * 0.5).astype(np.float16)
    dw, dx, dout = cu.alloc(w), cu.alloc(pack_mma_input(x16)), cu.alloc(blocks * 32 * 4)
    want = np.array([dec[w[u * 1024 : (u + 1) * 1024]] @ x16[(u % 2) * 1024 : (u % 2 + 1) * 1024].astype(np.float64) for u in range(32)])
    launch("probe_mma", [dw, dx, dout, 2])
    cu.ck(cu.lib.cuCtxSynchronize(), "sync")
    got = cu.read(dout, blocks * 32, np.float32).reshape(blocks, 32)
    err = np.abs(got - 2 * want).max() / np.abs(want).max()
    print(f"mma: sums vs numpy {err:.2e} ({'ok' if err < 1e-3 else 'WRONG'})")
    ms_mma = min(cu.timed(lambda: launch("probe_mma", [dw, dx, dout, iters])) for _ in range(3))

    # wgmma: 64 rows x 512 k.
    w2 = random_e4m3(rng, 64 * 512).reshape(64, 512)
    x2 = random_e4m3(rng, 512)
    slot, b = pack_wgmma(w2, x2)
    want2 = dec[w2] @ dec[x2]
    ds, db, dout2 = cu.alloc(slot), cu.alloc(b), cu.alloc(blocks * 256 * 4)
    for lbo, sbo in ((128, 256), (256, 128)):
        launch("probe_wgmma", [ds, db, dout2, 2, lbo, sbo])
        cu.ck(cu.lib.cuCtxSynchronize(), "sync")
        got2 = cu.read(dout2, blocks * 256, np.float32).reshape(blocks, 4, 64).sum(axis=1)
        err2 = np.abs(got2 - 2 * want2).max() / np.abs(want2).max()
        print(f"wgmma lbo {lbo} sbo {sbo}: sums vs numpy {err2:.2e} ({'ok' if err2 < 1e-3 else 'wrong'})")
    ms_wg = min(cu.timed(lambda: launch("probe_wgmma", [ds, db, dout2, iters, 128, 256])) for _ in range(3))

    # HBM: a device-to-device copy's read rate, and an SM's share of one slot at it.
    n = 1 << 30
    src, dst = cu.alloc(n), cu.alloc(n)
    ms_copy = min(cu.timed(lambda: cu.ck(cu.lib.cuMemcpyDtoD_v2(dst, src, ctypes.c_size_t(n)), "copy")) for _ in range(3))
    bw = 2 * n / (ms_copy * 1e-3)  # bytes/s read + written
    per_slot_hbm = SLOT * blocks / bw * 1e9
    print(f"{blocks} SMs, {iters} passes a block")
    print(f"mma   (ring_f8_dot, f16 inputs):   {ms_mma * 1e6 / iters:8.1f} ns a 32 KB slot an SM")
    print(f"wgmma (m64n8k32 e4m3, e4m3 inputs): {ms_wg * 1e6 / iters:8.1f} ns a 32 KB slot an SM")
    print(f"HBM   (DtoD copy {bw / 1e12:.2f} TB/s):      {per_slot_hbm:8.1f} ns for every SM's slot")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="OUT")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--cubin")
    ap.add_argument("--iters", type=int, default=4000)
    a = ap.parse_args()
    if np is None and not a.build:
        sys.exit("f8_probe.py: numpy is needed (pip install numpy)")
    if a.build:
        build(a.build)
    elif a.selftest:
        selftest()
    elif a.cubin:
        run(a.cubin, a.iters)
    else:
        ap.error("one of --build, --selftest, --cubin")


if __name__ == "__main__":
    main()
