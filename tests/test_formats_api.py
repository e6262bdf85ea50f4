"""The formats table, derived sizes, and refusal of bad input."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim import formats

GGML = ["q8_0", "q5_1", "q5_0", "q4_1", "iq4_nl", "q4_0"]
TURBO = ["turbo4", "turbo3", "turbo2", "turbo4p", "turbo3p"]


def test_names_and_unknown_name_lists_valid_ones():
    assert formats.names()[:3] == ["f32", "f16", "bf16"]
    with pytest.raises(ValueError, match="valid types: f32, f16, bf16, q8_0"):
        formats.get("q3_turbo")


@pytest.mark.parametrize("name,block_bytes,bpv", [
    ("q8_0", 34, 8.5), ("q4_0", 18, 4.5), ("q4_1", 20, 5.0), ("q5_0", 22, 5.5),
    ("q5_1", 24, 6.0), ("iq4_nl", 18, 4.5), ("turbo2", 34, 2.125), ("turbo3", 50, 3.125),
    ("turbo4", 66, 4.125), ("f16", 2, 16.0), ("bf16", 2, 16.0), ("f32", 4, 32.0),
])
def test_block_sizes_match_llama_cpp(name, block_bytes, bpv):
    fmt = formats.get(name)
    assert fmt.spec.block_bytes == block_bytes
    assert fmt.bits_per_value(128) == bpv
    assert fmt.row_bytes(256) == 2 * fmt.row_bytes(128)


def test_turbo_small_and_odd_head_dims():
    assert formats.get("turbo4").row_bytes(64) == 2 + 32       # one group of 64
    assert formats.get("turbo3").row_bytes(96) == 2 + 36       # dense rotation group
    assert formats.get("turbo4p").row_bytes(128) == 68          # norm + residual norm + 3-bit + 1-bit
    with pytest.raises(ValueError, match="groups"):
        formats.get("turbo4").row_bytes(100)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        formats.get("q8_0").row_bytes(80)


@pytest.mark.parametrize("name", formats.standalone_names())     # klt3's own: test_formats_klt.py
def test_bad_input_is_refused_with_a_clear_message(name):
    fmt = formats.get(name)
    good = torch.randn(2, 128)
    for bad, msg in [
        (torch.tensor([[float("nan")] * 128]), "NaN or infinite"),
        (torch.full((1, 128), float("inf")), "NaN or infinite"),
        (torch.zeros(0, 128), "empty"),
        (torch.ones(2, 128, dtype=torch.int32), "floating-point"),
        ("not a tensor", "expected a torch.Tensor"),
    ]:
        with pytest.raises(ValueError, match=msg):
            fmt.encode(bad)
    packed = fmt.encode(good)
    with pytest.raises(ValueError, match="bytes per row"):
        fmt.decode(packed[..., :-1], 128)
    with pytest.raises(ValueError, match="torch.uint8"):
        fmt.decode(packed.to(torch.int16), 128)
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        fmt.decode(packed, 0)


def test_overflow_is_refused_not_stored_as_inf():
    with pytest.raises(ValueError, match="fp16"):
        formats.get("f16").encode(torch.full((1, 32), 1e5))
    with pytest.raises(ValueError, match="fp16"):
        formats.get("q8_0").encode(torch.full((1, 32), 1e9))
    with pytest.raises(ValueError, match="fp16"):
        formats.get("turbo4").encode(torch.full((1, 128), 1e4))


def test_wrong_head_dim_for_ggml_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        formats.get("q4_0").encode(torch.randn(3, 48))


@st.composite
def batches(draw):
    name = draw(st.sampled_from(formats.standalone_names()))
    fmt = formats.get(name)
    dims = [32, 64, 128, 256] if name in GGML else [128, 256] if fmt.spec.family == "nls" else [64, 128, 256]
    head_dim = draw(st.sampled_from(dims))
    if name in ("f32", "f16", "bf16"):
        head_dim = draw(st.integers(1, 300))
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = torch.randn(*lead, head_dim, generator=torch.Generator().manual_seed(seed)) * scale
    return fmt, x


@settings(max_examples=60, deadline=None)
@given(batches())
def test_round_trip_shapes_and_row_independence(case):
    fmt, x = case
    head_dim = x.shape[-1]
    packed = fmt.encode(x)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*x.shape[:-1], fmt.row_bytes(head_dim))
    y = fmt.decode(packed, head_dim)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # Rows are coded independently: encoding one row alone gives the same bytes.
    first = x.reshape(-1, head_dim)[:1]
    assert torch.equal(fmt.encode(first)[0], packed.reshape(-1, packed.shape[-1])[0])
    # Error is bounded relative to the row energy (generous: turbo2 is ~0.12).
    err = (x - y).pow(2).sum(-1) / x.pow(2).sum(-1)
    assert float(err.max()) < (0.6 if "turbo" in fmt.name else 0.05)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(GGML), st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_ggml_error_within_half_a_step(name, seed, scale):
    """Every decoded value lies within one quantization step of the input."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)) * scale
    fmt = formats.get(name)
    y = fmt.decode(fmt.encode(x), 32)
    rng = (x.amax(-1) - x.amin(-1)).unsqueeze(-1)
    steps = {"q8_0": 254, "q5_0": 30, "q5_1": 31, "q4_0": 14, "q4_1": 15, "iq4_nl": 12}[name]
    assert bool(((x - y).abs() <= rng / steps * 1.01 + 1e-6).all())


def test_fp16_bytes_of_a_column_laid_out_column_first():
    """An (N, 1) tensor with strides (1, N) counts as contiguous, so ``.contiguous()`` keeps that
    layout and a byte view of it is refused. inductor made such a layout for turbo's row scales
    in a compiled decode step; torch 2.11 (the GPU image's) then refused the step."""
    from kvslim.formats.base import fp16_bytes, fp16_from_bytes
    scales = torch.empty_strided((4, 1), (1, 4)).copy_(torch.tensor([[0.5], [-2.0], [1e-3], [6e4]]))
    packed = fp16_bytes(scales)
    assert packed.shape == (4, 1, 2) and packed.dtype == torch.uint8
    assert torch.equal(fp16_from_bytes(packed), scales.to(torch.float16).float())


def test_encode_works_on_the_tensor_device_and_keeps_it():
    x = torch.randn(4, 128, dtype=torch.float64)
    for name in ("q8_0", "turbo3", "bf16"):
        packed = formats.get(name).encode(x)
        assert packed.device == x.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", GGML + TURBO)
def test_cuda_matches_cpu(name):
    """Encoding on the GPU gives the CPU's bytes, but for values that float rounding puts on the
    other side of a code boundary (turbo3 on the H200, session 31: 1 row of 512); decoding the
    same bytes agrees to float rounding."""
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))
    fmt = formats.get(name)
    a = fmt.encode(x)
    b = fmt.encode(x.cuda()).cpu()
    assert (a != b).any(-1).float().mean().item() <= 0.01                    # at most 5 of 512 rows
    assert (a != b).float().mean().item() < 1e-3                              # and a byte here and there in them
    assert torch.allclose(fmt.decode(a, 128), fmt.decode(a.cuda(), 128).cpu(), atol=1e-5)


def test_decoded_tensor_never_aliases_the_stored_bytes():
    for name in ("f32", "f16", "q8_0", "turbo4"):
        fmt = formats.get(name)
        packed = fmt.encode(torch.randn(2, 128))
        before = packed.clone()
        fmt.decode(packed, 128).add_(1.0)
        assert torch.equal(packed, before)
