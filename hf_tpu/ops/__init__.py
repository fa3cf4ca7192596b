"""ATen -> JAX lowerings, one module per op family; importing this package fills the registry."""

from . import elementwise, storage  # noqa: F401
from . import index, shape  # noqa: F401
from . import conv, linalg  # noqa: F401
from . import attention, factory, nn, random_ops  # noqa: F401
from . import reduce, sort  # noqa: F401
