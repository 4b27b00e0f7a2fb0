"""Commands around a run, installed with the wheel: ``trjax-plot``
(:mod:`trjax.tools.plot`: loss, top-1 and learning-rate curves of a workdir) and
``trjax-tiny-cifar`` (:mod:`trjax.tools.tiny_cifar`: a tiny CIFAR-10 in the real
on-disk format). Each is also ``python -m trjax.tools.NAME``; from a clone,
``scripts/plot.py`` and ``scripts/make_tiny_cifar.py`` call the same code.

Like :mod:`trjax.export`, these sit above the rest of trjax: they may import any
of it, and no trjax module imports them.
"""
