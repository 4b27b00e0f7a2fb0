"""The XLA:CPU backend: simulated devices, its convolution library, compile options, im2col.

Nothing here is used on a GPU. ``host`` sets up the CPU backend before jax
starts (a forced device count, the convolution library, thread counts);
``compile_options`` holds the XLA:CPU compile options of the steps and the
state initialisation; ``im2col`` routes the convolutions XLA:CPU runs slowly
through a matrix multiply.

This package imports nothing else of trjax.
"""
