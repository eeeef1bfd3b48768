"""Statistical functions (the standard's statistical section)."""

from ._generate import from_row

cumulative_prod = from_row("cumulative_prod")
cumulative_sum = from_row("cumulative_sum")
max = from_row("max")
mean = from_row("mean")
min = from_row("min")
prod = from_row("prod")
std = from_row("std")
sum = from_row("sum")
var = from_row("var")

__all__ = ["cumulative_prod", "cumulative_sum", "max", "mean", "min", "prod", "std", "sum", "var"]
