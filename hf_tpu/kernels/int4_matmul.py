"""Products with packed int4 weights on a TPU (`hf_tpu::int4_linear`), for decode and prefill, and their reference.

`x @ W.T` for `W[n, k] = q[n, k] * scale[k // group, n] + zero_point[k // group, n]`, with `q` the signed 4-bit
integers two to a byte of `qdata` (N, K/2), column `2j` in the low nibble of byte `j` (torchao's `Int4Tensor`,
`hf_tpu.ops.quantized`). XLA on the chip does not fuse the unpacking, conversion and scaling of the nibbles into
its product: it writes a dequantized copy of every weight at every call (3.9 GB a decode step of the 1.1B Llama,
whose packed weights are 352 MB). This kernel reads each tile of packed bytes into VMEM and unpacks it there into
both products. `jax.experimental.pallas.ops.tpu` has no kernel for this layout.

The grid is (row blocks, N blocks, K blocks), K innermost: each step reads a (block_n, block_k / 2) tile of
bytes, unpacks its low and high nibbles (the even and the odd input features) and multiplies them on the matrix
unit by the input's even and odd features. The output block stays in VMEM across the K steps, accumulated in
float32. The scales apply per group of input features, a slice of the tile's minor (lane) dimension, in one of
two forms (`_kernel`'s `apply_groups`):

- `_stacked_groups` (decode, up to `DECODE_ROWS` rows, one row block): rather than scaling each weight (which
  needs the scales spread along the lanes), the group is factored out of the product. The input rows are stacked
  once per group of the block, each copy zero outside its group's features, so one product gives every group's
  partial result, (groups x rows, block_n); each is scaled by its group's scale row and the zero point times the
  group's input sum is added:

      out[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] q[n, k] + zero_point[g, n] * sum_{k in g} x[m, k]

  The weight tile is loaded into the matrix unit once for all the stacked rows, so they cost no weight traffic;
  a block holds as many groups as fit one 128-row pass beside the input's rows (padded to 8), two passes where
  one holds no legal block (`_PREFERRED_STACKED_ROWS`, `_STACKED_ROWS`): 16 groups for one to eight rows.
- `_scaled_weight` (prefill, more rows, blocks of `_ROW_BLOCK`): stacking would multiply the matrix unit's work
  by the group count, so the tile is dequantized in VMEM as the reference does (in float32, rounded once to x's
  dtype), each group's scale column spread over its lanes by selects, then multiplied by the block's rows. The
  unpacking and scaling are paid once per row block; a block holds the fewest groups that make
  `_SCALED_BLOCK_BYTES` (each group costs two selects a byte).

Block sizes: block_k is that many groups (and a multiple of 256 input features, 128 bytes, the lane width),
or the whole K; block_n the widest of 2048, 1024, 512, 256, 128 that divides N and keeps a tile of bytes
within `_TILE_BYTES`. Scales and zero points come as blocks of the K block's groups: the (groups, N) arrays
viewed as (K blocks, groups, N) for the stacked form and (K blocks, N, groups) for the scaled one.

Shape rules (`unsupported` says which one a call breaks): x float32 or bfloat16, N a multiple of 128, and a K
block that the group size allows (above).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import selection

LANES = 128
SUBLANES = 8
DTYPES = (jnp.bfloat16, jnp.float32)
DECODE_ROWS = 64  # at most this many rows stack their groups (decode); more rows scale the weight tile (prefill)
_STACKED_ROWS = 256  # groups x padded rows in one product, at most: two of the matrix unit's 128-row passes
_PREFERRED_STACKED_ROWS = 128  # one pass: on a v5e, 2.24 ms for the 1.1B's products against 256 rows' 2.40 ms
_TILE_BYTES = 2 << 20  # packed bytes of one weight tile (unpacked in VMEM it takes 8 times that): 2 MiB, as above
_ROW_BLOCK = 256  # input rows of a prefill block: the weight tile is unpacked and scaled once for them (x's
# float32 block is read once per N block and the weight once per row block: 256 rows x 2048 columns read both alike)
_SCALED_BLOCK_BYTES = 256  # packed bytes of a prefill K block at least (512 features), where the groups allow
PREFILL_ROWS = 1024  # at most this many rows take the kernel: each row block unpacks every weight tile again on
# the vector unit (about 1.4 ms for the 1.1B's packed weights by its throughput), so past four blocks XLA's product
# of a dequantized weight (written once a call: about 8 ms for the 1.1B's at the HBM's bandwidth) costs less. An
# estimate: `python -m benchmarks.int4_kernel --batches 128,1024,2048` on the chip times both forms at each side


def _rows(m: int, multiple: int = SUBLANES) -> int:
    return -(-m // multiple) * multiple


def _row_block(rows: int) -> int:
    """Rows of one block of the row grid axis: all of them for decode and short prefills, else `_ROW_BLOCK`."""
    return min(_rows(rows), _ROW_BLOCK)


def _whole_lanes(groups: int, group_size: int) -> list:
    """The group counts a K block may hold: divisors of the group count whose bytes fill whole lanes, or all of
    the groups (the whole K, legal as a full dimension)."""
    return [g for g in range(1, groups + 1)
            if groups % g == 0 and (g == groups or (g * group_size // 2) % LANES == 0)]


def _groups_per_block(in_features: int, group_size: int, rows: int) -> int | None:
    """The groups of a K block. Decode (stacked groups): the most whose stacked rows fit `_PREFERRED_STACKED_ROWS`,
    else `_STACKED_ROWS`. Prefill (scaled weight): the fewest that hold `_SCALED_BLOCK_BYTES` (each group of the
    block costs two selects per byte of the tile), else the most there are. None when no count is legal."""
    fits = _whole_lanes(in_features // group_size, group_size)
    if rows > DECODE_ROWS:
        wide = [g for g in fits if g * group_size // 2 >= _SCALED_BLOCK_BYTES]
        return min(wide) if wide else max(fits)
    fits = [g for g in fits if g * rows <= _STACKED_ROWS]
    preferred = [g for g in fits if g * rows <= _PREFERRED_STACKED_ROWS]
    return max(preferred or fits) if fits else None


def _block_n(out_features: int, block_bytes: int) -> int:
    return next((b for b in (2048, 1024, 512, 256) if out_features % b == 0 and b * block_bytes <= _TILE_BYTES),
                LANES)


def unsupported(x, qdata, scale, zero_point, group_size) -> str | None:
    """Why the kernel cannot compute this call (a sentence), or None. Shapes and dtypes only (works on tracers);
    `x` is (rows, K) or has leading dimensions that flatten into rows."""
    if x.dtype not in DTYPES:
        return f"input dtype {x.dtype}: the kernel takes bfloat16 or float32"
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    if rows > PREFILL_ROWS:
        return f"{rows} rows: more than {PREFILL_ROWS} unpack each weight tile more often than a dequantized copy costs"
    out_features, in_features = qdata.shape[0], 2 * qdata.shape[1]
    if out_features % LANES:
        return f"{out_features} output features must be a multiple of {LANES}"
    if _groups_per_block(in_features, group_size, _rows(rows)) is None:
        return (f"group size {group_size} over {in_features} input features: no K block of whole groups fills "
                f"whole lanes ({2 * LANES} features) within {_STACKED_ROWS // _rows(rows)} groups")
    return None


def _lane_groups(shape: tuple, group_bytes: int):
    """The group of each lane of a (rows, block_bytes) block of bytes or features."""
    return jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 1), jnp.int32(group_bytes))


def _stacked_groups(even, odd, low, high, scale_ref, zero_point_ref, *, groups: int, group_bytes: int, dtype):
    """Decode: the groups factored out of the product. The rows are stacked once per group, each copy zero outside
    its group's features, so one product gives every group's partial result; each is scaled by its group's scale
    row and its input sum times the zero-point row is added. scale_ref, zero_point_ref: (groups, block_n)."""
    from jax.experimental import pallas as pl

    rows = even.shape[0]
    lane_group = _lane_groups(even.shape, group_bytes)

    def stacked(features):  # (rows, block_bytes) -> (groups * rows, block_bytes): row g*rows + m is x[m] on group g
        return jnp.concatenate([jnp.where(lane_group == g, features, 0.0) for g in range(groups)], axis=0)

    even, odd = stacked(even), stacked(odd)
    partial = _products(even.astype(dtype), odd.astype(dtype), low.astype(dtype), high.astype(dtype))
    sums = jnp.sum(even + odd, axis=1, keepdims=True)  # (groups * rows, 1): each group's input sum per row
    total = 0.0
    for g in range(groups):  # each group's scale and zero point: a row of the block, broadcast over the rows
        scale = scale_ref[pl.ds(g, 1), :].astype(jnp.float32)
        zero_point = zero_point_ref[pl.ds(g, 1), :].astype(jnp.float32)
        total += partial[g * rows:(g + 1) * rows] * scale + sums[g * rows:(g + 1) * rows] * zero_point
    return total


def _scaled_weight(even, odd, low, high, scale_ref, zero_point_ref, *, groups: int, group_bytes: int, dtype):
    """Prefill: the weight tile dequantized in VMEM, as the reference does (in float32, rounded once to the
    input's dtype), then one product for all the block's rows. scale_ref, zero_point_ref: (block_n, groups),
    each group's column spread over its lanes by selects (both nibbles of a byte share a group)."""
    lane_group = _lane_groups(low.shape, group_bytes)

    def spread(ref):  # (block_n, groups) -> (block_n, block_bytes)
        columns = ref[...].astype(jnp.float32)
        spread = jnp.broadcast_to(columns[:, 0:1], low.shape)
        for g in range(1, groups):
            spread = jnp.where(lane_group == g, columns[:, g:g + 1], spread)
        return spread

    scale, zero_point = spread(scale_ref), spread(zero_point_ref)
    return _products(even.astype(dtype), odd.astype(dtype), (low * scale + zero_point).astype(dtype),
                     (high * scale + zero_point).astype(dtype))


def _products(even, odd, low, high):
    """even @ low.T + odd @ high.T on the matrix unit, accumulated in float32."""
    transposed_rhs = (((1,), (1,)), ((), ()))
    return (jax.lax.dot_general(even, low, transposed_rhs, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(odd, high, transposed_rhs, preferred_element_type=jnp.float32))


def _kernel(x_ref, qdata_ref, scale_ref, zero_point_ref, out_ref, *, apply_groups, groups: int, group_bytes: int,
            dtype):
    """One (row block, N block, K block) step. x_ref (2, block_m, block_bytes) float32: the even and odd input
    features of this K block; qdata_ref (block_n, block_bytes) int8; scale_ref, zero_point_ref: this K block's
    groups, in `apply_groups`'s layout; out_ref (block_m, block_n) float32, resident across the K steps."""
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(2) == 0)
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    packed = qdata_ref[...].astype(jnp.int32)  # sign-extended bytes
    low = ((packed << 28) >> 28).astype(jnp.float32)  # columns 2j: small integers, exact in any float dtype
    high = (packed >> 4).astype(jnp.float32)  # columns 2j + 1
    out_ref[...] += apply_groups(x_ref[0], x_ref[1], low, high, scale_ref, zero_point_ref, groups=groups,
                                 group_bytes=group_bytes, dtype=dtype)


@selection.in_32_bit_mode
def int4_matmul(x, qdata, scale, zero_point, group_size: int, *, groups_per_block: int | None = None,
                block_n: int | None = None, block_m: int | None = None, interpret: bool | None = None):
    """(..., K) x packed (N, K/2) -> (..., N) in x's dtype, accumulated in float32 (module docstring).
    `groups_per_block`, `block_n`, `block_m`: override the block sizes (tests use small ones to run several
    steps); a `block_m` above `DECODE_ROWS` scales the weight tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if qdata.dtype == jnp.uint8:
        qdata = jax.lax.bitcast_convert_type(qdata, jnp.int8)
    leading, in_features = x.shape[:-1], x.shape[-1]
    out_features, half = qdata.shape
    x = x.reshape(-1, in_features)
    m = x.shape[0]
    block_m = block_m or _row_block(m)
    rows = _rows(m, block_m)
    groups = groups_per_block or _groups_per_block(in_features, group_size, block_m)
    if groups is None:
        raise ValueError(f"int4_matmul: {unsupported(x, qdata, scale, zero_point, group_size)}")
    group_bytes = group_size // 2
    block_bytes = groups * group_bytes
    block_n = block_n or _block_n(out_features, block_bytes)
    interpret = selection.interpret() if interpret is None else interpret

    # (2, rows, K/2): the even and the odd features, the rows padded to whole blocks
    features = x.astype(jnp.float32).reshape(m, half, 2).transpose(2, 0, 1)
    features = jnp.pad(features, ((0, 0), (0, rows - m), (0, 0)))
    # the scales as (K blocks, groups, N) for stacked groups and (K blocks, N, groups) for a scaled weight: a
    # block's groups are then a whole dimension, a legal block of any size (a copy of the scales when there are
    # several K blocks or the layout is transposed: 1/32 of the packed bytes at groups of 128)
    steps = half // block_bytes
    scale, zero_point = (s.reshape(steps, groups, out_features) for s in (scale, zero_point))
    if block_m > DECODE_ROWS:
        apply_groups, group_block, group_index = _scaled_weight, (None, block_n, groups), lambda i, n, k: (k, n, 0)
        scale, zero_point = (s.astype(jnp.float32).transpose(0, 2, 1) for s in (scale, zero_point))
    else:
        apply_groups, group_block, group_index = _stacked_groups, (None, groups, block_n), lambda i, n, k: (k, 0, n)
    out = pl.pallas_call(
        functools.partial(_kernel, apply_groups=apply_groups, groups=groups, group_bytes=group_bytes, dtype=x.dtype),
        out_shape=jax.ShapeDtypeStruct((rows, out_features), jnp.float32),
        grid=(rows // block_m, out_features // block_n, steps),
        in_specs=[
            pl.BlockSpec((2, block_m, block_bytes), lambda i, n, k: (0, i, k)),
            pl.BlockSpec((block_n, block_bytes), lambda i, n, k: (n, k)),
            pl.BlockSpec(group_block, group_index),
            pl.BlockSpec(group_block, group_index),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, n, k: (i, n)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=64 * 2**20),
        interpret=interpret,
    )(features, qdata, scale, zero_point)
    return out[:m].astype(x.dtype).reshape(*leading, out_features)


def reference(x, qdata, scale, zero_point, group_size: int):
    """The same product in plain jnp: the weight dequantized in float32, rounded once to x's dtype, then a product
    accumulated in float32 (`hf_tpu.ops.quantized`'s CPU reference, in JAX)."""
    if qdata.dtype == jnp.uint8:
        qdata = jax.lax.bitcast_convert_type(qdata, jnp.int8)
    out_features, half = qdata.shape
    q = jnp.stack([(qdata << 4) >> 4, qdata >> 4], axis=-1).reshape(out_features, 2 * half).astype(jnp.float32)
    grouped = q.reshape(out_features, -1, group_size)
    weight = grouped * scale.astype(jnp.float32).T[:, :, None] + zero_point.astype(jnp.float32).T[:, :, None]
    weight = weight.reshape(out_features, 2 * half).astype(x.dtype)
    return jnp.einsum("...k,nk->...n", x, weight, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
