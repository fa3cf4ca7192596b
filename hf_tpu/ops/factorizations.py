"""Factorizations in LAPACK's compact forms: Householder QR (`geqrf`, and `ormqr` applying its Q)
and the Bunch-Kaufman LDL^T of a symmetric matrix (`linalg_ldl_factor_ex`, `linalg_ldl_solve`).

These ops return LAPACK's own encodings (reflectors below the diagonal with their `tau` factors;
L, D and 1-based pivot indices in one matrix), so they follow LAPACK's algorithms step for step:
the CPU results they are compared with come from LAPACK itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .registry import lowering

aten = torch.ops.aten


# --- Householder QR.


@lowering(aten.geqrf.default)
def geqrf(self):
    reflectors, tau = jnp.linalg.qr(self, mode="raw")  # numpy's raw form is the transpose of LAPACK's
    return jnp.swapaxes(reflectors, -1, -2), tau


@lowering(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    """Q @ C (or C @ Q, with Q^H for `transpose`) for the Q that `geqrf` encoded in (self, input2)."""
    return jax.lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)
