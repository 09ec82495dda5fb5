"""Native code and its build, below the backends (which import it; it imports none of them).

- :mod:`~selfattn.kernels.features`: what the CPU runs (instruction sets, native half precision),
  asked lazily; a leaf that imports nothing of the package;
- :mod:`~selfattn.kernels.build`: the C++ sources compiled on first use for the CPU's vectors, kept
  in a cache, and why a build cannot be had (the callers then keep PyTorch's kernels);
- :mod:`~selfattn.kernels.matvec`: the operators of that library: a few rows times a matrix
  (``rows``), a few queries over the KV cache (``attend``), and a decoder's whole decode step
  (``step``, which :mod:`selfattn.generation.kernel_step` drives);
- the sources: ``matvec.h`` (the vector helpers and the product and attention loops both files
  share), ``matvec.cpp`` (``rows``, ``attend``), ``decode.cpp`` (``step``).

Importing this package runs no probe and builds nothing.
"""
