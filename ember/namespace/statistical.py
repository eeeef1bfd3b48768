"""Statistical functions (the standard's statistical section)."""

from ._generate import accumulating, from_row

cumulative_prod = accumulating(from_row("cumulative_prod"))
cumulative_sum = accumulating(from_row("cumulative_sum"))
max = from_row("max")
mean = from_row("mean")
min = from_row("min")
prod = accumulating(from_row("prod"))
std = from_row("std")
sum = accumulating(from_row("sum"))
var = from_row("var")

__all__ = ["cumulative_prod", "cumulative_sum", "max", "mean", "min", "prod", "std", "sum", "var"]
