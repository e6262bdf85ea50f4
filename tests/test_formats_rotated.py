"""ggml types rotated as llama.cpp b11739 stores them (PR #21038): bytes are plain ggml
blocks (gguf.quants) of the Hadamard-rotated row; K in blocks of the largest power of
two dividing head_dim, V in blocks of 64; LLAMA_ATTN_ROT_DISABLE=1 turns it off."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from kvslim import formats
from kvslim.formats.rotation import hadamard_blocks, hadamard_blocks_torch, hadamard_matrix, llama_rot_size
from kvslim.native import build
from kvslim.native import kv_encode

ORACLE_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def llama_hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard's definition, written independently: H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i & j)
    return (1 - 2 * parity) / np.sqrt(n)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_hadamard_is_llamas_orthonormal_walsh_hadamard(n):
    h = hadamard_matrix(n).double().numpy()
    np.testing.assert_allclose(h, llama_hadamard(n), atol=1e-7)
    np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-6)              # symmetric and self-inverse


@pytest.mark.parametrize("variant", list(build.VARIANTS))
@pytest.mark.parametrize("shape,n", [((512, 2, 128), 128), ((512, 2, 128), 64), ((1, 16, 256), 256), ((7, 3, 64), 64)])
def test_c_butterfly_gives_the_torch_butterflys_bits(variant, shape, n):
    """The CPU path of hadamard_blocks (C) and its torch reference: equal to the bit, so a row
    encodes to the same bytes through either (and through the native decode step's encoder);
    inputs not contiguous and not float32 too."""
    if not build.compiler():
        pytest.skip("no C compiler: the torch butterfly serves")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 4, shape[-1])
    ref = hadamard_blocks_torch(x, n)
    assert torch.equal(kv_encode.hadamard_rows(x, n, variant), ref)
    assert torch.equal(hadamard_blocks(x, n), ref)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)           # same values, other strides
    assert torch.equal(kv_encode.hadamard_rows(strided.bfloat16(), n, variant),
                       hadamard_blocks_torch(strided.bfloat16(), n))
    assert torch.equal(hadamard_blocks(hadamard_blocks(x, n), n), hadamard_blocks_torch(ref, n))


@pytest.mark.parametrize("head_dim,k,v", [(128, 128, 64), (256, 256, 64), (192, 64, 64), (64, 64, 64),
                                          (320, 64, 64), (96, 0, 0), (32, 0, 0)])
def test_rotation_sizes_follow_upstream(head_dim, k, v):
    assert (llama_rot_size(head_dim, "k"), llama_rot_size(head_dim, "v")) == (k, v)


@pytest.mark.parametrize("name", ORACLE_TYPES)
@pytest.mark.parametrize("role,n", [("k", 128), ("v", 64)])
def test_rotated_bytes_are_gguf_blocks_of_the_rotated_row(name, role, n):
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(1)) * 3
    x[:, 5] += 40.0                                                       # a channel outlier, as keys have
    fmt = formats.get(name, role=role)
    rotated = hadamard_blocks(x, n)                      # the matrix itself is checked against llama's above
    np.testing.assert_allclose(rotated.double().numpy(), (x.reshape(300, -1, n).double() @ torch.from_numpy(
        llama_hadamard(n))).reshape(300, 128).numpy(), atol=1e-4)
    ref = quants.quantize(rotated.reshape(-1, 32).numpy(), T[name.upper()]).reshape(300, -1)
    np.testing.assert_array_equal(fmt.encode(x).numpy(), ref)


def test_rotated_iq4_nl_is_iq4_nl_of_the_rotated_row():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    got = formats.get("iq4_nl").encode(x)
    want = formats.get("iq4_nl-norot").encode(hadamard_blocks(x, 256))
    assert torch.equal(got, want)
    back = quants.dequantize(got.reshape(-1, 18).numpy(), T.IQ4_NL).reshape(64, 256)
    np.testing.assert_allclose(hadamard_blocks(torch.from_numpy(back), 256).numpy(),
                               formats.get("iq4_nl").decode(got, 256).numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "iq4_nl"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_hooks_keep_scores_and_values(name, role):
    fmt = formats.get(name, role=role)
    assert fmt.transformed
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    q = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    packed = fmt.encode(x)
    plain = fmt.decode(packed, 128)
    coded = fmt.decode_code_domain(packed, 128)
    torch.testing.assert_close(fmt.to_code_domain(q) @ coded.T, q @ plain.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fmt.from_code_domain(coded), plain, atol=1e-5, rtol=1e-5)
    assert fmt.row_layout(128).row_bytes == fmt.row_bytes(128)


def test_rotation_lowers_error_on_outlier_channels():
    x = torch.randn(2000, 128, generator=torch.Generator().manual_seed(5))
    x[:, 3] *= 30.0
    err = {}
    for name in ("q4_0", "q4_0-norot"):
        fmt = formats.get(name)
        err[name] = float(((fmt.decode(fmt.encode(x), 128) - x) ** 2).mean())
    assert err["q4_0"] < 0.5 * err["q4_0-norot"], err


def test_small_heads_are_not_rotated():
    x = torch.randn(10, 32)
    assert torch.equal(formats.get("q4_0").encode(x), formats.get("q4_0-norot").encode(x))


@pytest.mark.parametrize("value,rotated", [("1", False), ("0", True), ("", True), ("yes", True)])
def test_llama_attn_rot_disable(monkeypatch, value, rotated):
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", value)
    fmt = formats.get("q4_0")
    assert fmt.spec.rotated is rotated
    assert fmt.name == ("q4_0" if rotated else "q4_0-norot")
    assert formats.get("turbo4").name == "turbo4"


def test_overflow_is_checked_after_rotation():
    x = torch.zeros(1, 128)
    x[0, :] = 6e4                                     # fits fp16 per value, the rotated sum does not
    with pytest.raises(ValueError, match="exceeds"):
        formats.get("q4_0").encode(x)
    assert bool(formats.get("q4_0").overflow_flag(x))
    formats.get("q4_0-norot").encode(x)


def test_bad_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        formats.get("q4_0", role="q")
