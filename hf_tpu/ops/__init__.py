"""ATen -> JAX lowerings, one module per op family; importing this package fills the registry
(`hf_tpu.dispatch.registry`), through the decorators `hf_tpu.dispatch` exports."""

from . import (  # noqa: F401
    attention,
    conv,
    cross_entropy,
    ctc,
    distances,
    elementwise,
    factorizations,
    factory,
    fft,
    foreach,
    histogram,
    index,
    linalg,
    nn,
    optim,
    products,
    quantized,
    random,
    reduce,
    shape,
    sort,
    special,
    memory,
)
