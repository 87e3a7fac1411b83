"""Our Triton kernels, one file each; the backends and ``mla.cache_append`` call them.

- ``decode``: MLA paged decode (dense and top-k sparse; bf16/fp16/fp32, fp8_e4m3 and fp8_ds_mla caches).
- ``decode_hopper``: the same decode in Gluon for SM90 (dense and sparse; bf16/fp16, fp8_e4m3 and fp8_ds_mla, 64
  heads per program; a 16-head variant for fp8 caches); ``decode`` launches it where it covers the call.
- ``cache_append``: writes new tokens into a paged cache (quantizing for fp8), no host sync.
- ``fp8_query``: per-tensor e4m3 quantization of a query on the device.
- ``empty_rows``: the epilogue giving rows that see no key out 0 and lse -inf.
- ``merge_attn_states``: merges partial attention results by their LSE (``mla.merge_attn_states(_n)`` on CUDA).
- ``launch``: relaunches a compiled kernel with little host work (``KernelLaunch``), for kernels launched
  once per call with arguments fixed by the call's shapes.

Each module imports triton at its top: import them only where a kernel is about to run.
"""
