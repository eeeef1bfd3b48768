"""Layer 5 — the Array API namespace, one module per section of the standard.

Most functions are generated from op rows (``_generate.from_row``); a function is written by
hand only where the standard's semantics need more than one row (scalars in elementwise
functions, ``asarray``, compositions such as ``meshgrid``). Importing it gives the array object
its operators (``methods.install``).
"""

from .methods import install as _install

_install()
