"""Each format's declared ``kernel_encoder``: what the C step (kvslim/native/kv_encode.c) and the
Triton append kernel (kvslim/gpu/kv_append.py) read instead of the format's class.

The parity tests of those encoders (tests/test_native_step.py, tests/test_triton_append.py)
hold the bytes to the torch encoders; these check that a declaration describes its format:
the same rotation as its code domain, the same blocks as the row it decodes, tables fit for
the kernels (float32 on the CPU, ascending).
"""
from __future__ import annotations

import pytest
import torch

from kvslim.formats.rotation import hadamard_blocks

from .test_native_attention import formats_fitting

NO_ENCODER = {"turbo4p", "turbo3p", "klt3"}      # a QJL sketch; klt3 is calibrated per model: the torch path codes them


def _declared(head_dim: int):
    for fmt in formats_fitting(head_dim):
        yield fmt, fmt.kernel_encoder(head_dim)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_which_formats_declare_an_encoder(head_dim):
    """Every format but the ones with a QJL sketch or a calibration."""
    names = {fmt.name for fmt, enc in _declared(head_dim) if enc is None}
    assert names == NO_ENCODER


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_declared_rotation_is_the_formats_code_domain(head_dim):
    """The butterfly or the matrix of the declaration takes a row where the format's own
    to_code_domain does (turbo rotates group by group: y = R x)."""
    x = torch.randn(3, head_dim, generator=torch.Generator().manual_seed(0))
    for fmt, enc in _declared(head_dim):
        if enc is None:
            continue
        if enc.rot_matrix is not None:
            y = (x.reshape(3, -1, enc.rot) @ enc.rot_matrix.T).reshape(3, head_dim)
            assert torch.allclose(y, fmt.to_code_domain(x), atol=1e-5), fmt.name
        else:
            assert enc.hadamard == (enc.rot > 0), fmt.name
            assert torch.equal(hadamard_blocks(x, enc.rot), fmt.to_code_domain(x)), fmt.name


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_declared_blocks_and_tables_fit_the_row(head_dim):
    """Blocks as the kernels decode them (kernel_row), codes within the declared bits, tables
    float32 on the CPU with ascending values and one boundary between each pair."""
    for fmt, enc in _declared(head_dim):
        if enc is None:
            continue
        row = fmt.kernel_row(head_dim)
        assert enc.block == row.block_values and enc.bits == (row.bits if enc.kind != "float" else 0), fmt.name
        for table in (enc.rot_matrix, enc.boundaries, enc.centroids, enc.tries, enc.ladder):
            assert table is None or (table.dtype == torch.float32 and table.device.type == "cpu")
        if enc.centroids is not None:
            assert len(enc.centroids) == 1 << enc.bits and bool((enc.centroids.diff() > 0).all())
        if enc.boundaries is not None:
            assert len(enc.boundaries) == len(enc.centroids) - 1
            assert bool(((enc.boundaries > enc.centroids[:-1]) & (enc.boundaries < enc.centroids[1:])).all())
        assert enc.limit >= 0
