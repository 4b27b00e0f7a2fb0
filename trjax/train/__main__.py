"""``python -m trjax.train --config default --workdir DIR [--config.KEY=VALUE ...]``: the
main job, as the ``trjax-train`` command (:mod:`trjax.train.main`)."""

from trjax.train.main import __doc__ as _usage, run

__doc__ = _usage  # absl's --help prints the __main__ module's docstring

if __name__ == "__main__":
    run()
