"""Sparse and block-sparse all-reduce (SparCML and OmniReduce).

The same plans as the dense algorithms (``flowreduce._plan``), lowered with
kernels that move only non-zeros:

* :mod:`flowreduce.sparse.plan` -- pure: :class:`SparsePlan`, a plan whose
  messages carry index+value pairs (or non-zero blocks), with a cost card
  that depends on density, the dense-switch rule, the quantisation error
  bound, and the ``auto`` rule for sparse inputs.
* :mod:`flowreduce.sparse.inputs` -- what a sparse input is (format, shape,
  dtype, nnz) and checks that all ranks agree.
* :mod:`flowreduce.sparse.build` -- the lowering (imports dask, never
  distributed), with the kernels in ``_kernels`` (scipy.sparse segments),
  ``_blocks`` (non-zero blocks) and ``_payload`` (wire formats, quantisation).

``flowreduce.allreduce`` dispatches here when the inputs are scipy.sparse or
the algorithm is one of :data:`SPARSE_ALGORITHMS`. This package's
``__init__`` stays pure (no dask) so the planners can import it.
"""

from __future__ import annotations

from flowreduce.sparse.plan import CODECS, SparsePlan, choose_sparse, quantisation_bound, switch_density

__all__ = ["CODECS", "SparsePlan", "choose_sparse", "quantisation_bound", "switch_density"]
