"""One file per op family; importing this package registers every rule."""
from autopar.sharding.rules import (  # noqa: F401
    attention, conv, embedding, loss, matmul, norm, pointwise, reduction, views,
)
