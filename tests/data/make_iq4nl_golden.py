"""Write iq4_nl_golden.npz: blocks quantized by llama.cpp's own libggml.

gguf.quants has no iq4_nl quantizer, so the oracle is libggml itself, reached
through ctypes from an installed llama-cpp-python (built from source, with
GGML_NATIVE=OFF so the C reference is compiled without FMA contraction):

    python tests/data/make_iq4nl_golden.py [--n 4096] [--check 100000]

--check N compares kvslim against libggml on N further random blocks and prints
the count of differing blocks without saving them.
"""
import argparse
import ctypes
import pathlib
import sys

import numpy as np
import torch

HERE = pathlib.Path(__file__).parent
GGML_TYPE = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}


def load_libggml() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  (its lib/ folder holds libggml*.so)
    libdir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    for dep in ("libggml-base.so", "libggml-cpu.so"):
        if (libdir / dep).exists():
            ctypes.CDLL(str(libdir / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(libdir / "libggml.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(lib, x: np.ndarray, type_name: str, block_bytes: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], block_bytes), dtype=np.uint8)
    lib.ggml_quantize_chunk(GGML_TYPE[type_name], x.ctypes.data, out.ctypes.data, 0, x.shape[0], 32, None)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--check", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from test_formats_ggml import edge_blocks, random_blocks
    from kvslim import formats
    lib = load_libggml()
    if args.check:
        x = random_blocks(args.check, 123)
        for name in GGML_TYPE:
            ours = formats.get(name).encode(torch.from_numpy(x)).numpy()
            ref = ggml_quantize(lib, x, name, formats.get(name).spec.block_bytes)
            print(f"{name}: {int((ours != ref).any(-1).sum())} of {len(x)} blocks differ from libggml")
        return
    x = np.concatenate([random_blocks(args.n, 7), edge_blocks()])
    q = ggml_quantize(lib, x, "iq4_nl", 18)
    np.savez_compressed(HERE / "iq4_nl_golden.npz", x=x, q=q)
    print(f"wrote {len(x)} blocks to {HERE / 'iq4_nl_golden.npz'}")


if __name__ == "__main__":
    main()
