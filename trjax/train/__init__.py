"""The trainer around the design: config, the built trainer, the loop, checkpoints, stops.

``train_and_evaluate(config, workdir)`` is the whole job (the Flax ImageNet
example's shape); :func:`prepare` and :func:`setup` build what it runs, and
:func:`evaluate_pass` is one exact validation pass.

Modules: ``config`` (config keys, their table and validation), ``trainer``
(config -> world -> model, plan, exchange -> state -> compiled steps),
``loop`` (epochs of steps, evaluation, checkpoints), ``loop_io`` (the loop's
host side: metric reads, step log, config file, profiler), ``metrics_log``,
``checkpoint`` (orbax), ``stops`` (signals and exit codes), ``workdir`` (one
live run per workdir), ``distributed`` (several processes), ``compilation``
(jax's persistent compilation cache, compiles counted by phase).

Nothing else inside trjax imports this package.
"""

from trjax.train.loop import train_and_evaluate  # noqa: F401
from trjax.train.trainer import Trainer, evaluate_pass, prepare, setup  # noqa: F401
