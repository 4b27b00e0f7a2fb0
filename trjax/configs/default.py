"""Default: CIFAR-style ResNet-20 on scikit-learn's digits, 8 (simulated) devices.

Run:    trjax-train --config default --workdir runs/default
        (from a clone: python scripts/train.py --config configs/default.py --workdir ...)
Reaches: val_top1 0.98-1.00 on the 360 held-out digits (seeds 0-2 on a 2-core Xeon,
        2026-12-03: 1.0000, 0.9833, 0.9861; the last bits follow the host's convolution
        kernels); world size 8 simulated CPU devices (on a GPU host: all GPUs).
        Times: docs/performance.md. Every key: trjax-train --help.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # data
    c.dataset = "digits"           # or cifar10, cifar100, mnist, fashion_mnist, imagefolder
    c.data_dir = ""                # folder of a data set on disk (not needed for digits)
    c.image_size = 224             # imagefolder only: train/eval crop size
    c.augment = False              # random crop (4 px zero padding) + flip; RandomResizedCrop
    #                                + flip for imagefolder; per (seed, epoch, example)
    c.prefetch = 2                 # batches prepared ahead on a host thread; 0: no thread
    c.data_workers = -1            # imagefolder: decode in N worker processes (grain, the
    #                                'grain' extra); -1: the cores available (in this process
    #                                when grain is missing); 0: in this process. Same batches.
    c.verify_images = False        # imagefolder: decode every file once before training; a bad
    #                                file is an error naming it (or skipped, see below)
    c.skip_bad_images = False      # imagefolder: skip undecodable files (row masked out),
    #                                count them in summary.json "skipped_images"
    c.train_remainder = "pad"      # "pad" (mask-0 rows, every example once) or "drop"; with
    #                                full batches only (drop, or a split that divides by the
    #                                global batch) the train step has no BN padding mask
    # world
    c.devices = "all"              # "all", a count "4", a range "0-3", a list "0,2,5"
    c.cpu_devices = 8              # simulated CPU devices when there is no accelerator
    c.cpu_convolutions = "auto"    # XLA:CPU convolutions: "eigen", "ynnpack"; auto: eigen
    #                                when cpu_devices <= cores (trjax.cpu.host)
    c.conv_lowering = "auto"       # strided convolutions and windows larger than their input:
    #                                "im2col" (+ one matmul; XLA:CPU's are slower),
    #                                "xla"; auto: im2col on CPU (trjax.cpu.im2col)
    c.cpu_reuse_memory = False     # glibc keeps freed host memory: no page faults per step;
    #                                pays for big models only (trjax.cpu.host)
    c.mesh = ""                    # "" (one data axis over every device), or named axes,
    #                                data outermost: "data:2,fsdp:4" (FSDP), "data:2,stage:4"
    #                                (pipeline) or "data:4,model:2" (tensor parallel);
    #                                "auto": the planner's fastest that fits memory_per_device
    #                                (trjax.train.planner); docs/parallelism.md
    c.memory_per_device = ""       # mesh="auto": the budget, e.g. "24GiB" ("" : the device's
    #                                own limit; a CPU needs one)
    c.plan_hardware = ""           # mesh="auto": "h100", "h200", "cpu" (calibrated) or a JSON
    #                                file (trjax.hardware); "": the devices' own
    c.plan_axes = ""               # mesh="auto": the axes it may use, e.g. "data,fsdp" ("": all)
    c.pipeline_microbatches = 0    # micro-batches per step on a 'stage' mesh (0: up to
    #                                4 x stages, keeping >= 16 rows per BatchNorm)
    c.pipeline_stage_starts = ""   # "" (by MACs, then parameters) or the blocks that begin stages
    #                                1..S-1, e.g. "stage2_block1,stage3_block1"
    c.pipeline_schedule = "gpipe"  # "gpipe", "1f1b" (stashes at most 2S-1 stage inputs) or
    #                                "zb-h1" (zero bubble: B and W apart, W fills the bubbles)
    c.pipeline_remat = True        # gpipe: recompute each stage in the backward (1f1b always does)
    c.tensor_plan = ""             # a 'model' mesh: "" (a built-in ResNet's own split) or the
    #                                layers to split, "Conv_1=column,Conv_2=row,Dense_0=column"
    #                                (module paths, '*' one component; trjax.parallel.tensor)
    c.remat = "none"               # activation checkpointing: "none", "blocks" (a ResNet's
    #                                residual blocks, a Sequential's layers) or module paths,
    #                                "layers_*,encoder/*Block_*" (trjax.remat)
    c.remat_policy = "nothing_saveable"  # what a remat block keeps: trjax.remat.POLICIES
    c.fsdp_reshard_after_forward = False  # an 'fsdp' mesh: free the gathered parameters after
    #                                the forward, the backward gathers each bucket again
    #                                (FSDP2's reshard_after_forward; docs/parallelism.md)
    c.global_batch_size = 128
    c.eval_batch_size = 128        # global; must divide by the world size too
    # model
    c.model = "resnet20"           # a name of trjax.models.MODELS, or an import path
    #                                "package.module:Name" of a flax Module class or a factory
    c.model_kwargs = ml_collections.ConfigDict()  # more keyword arguments for the model
    #                                (--config.model_kwargs="{'width': 32}")
    c.init_from = ""               # a fresh run's weights, by name: a trjax workdir, a .npz or
    #                                a flax .msgpack; a leaf of another shape (the classifier)
    #                                is re-initialised (trjax.train.init_from); "": none
    c.bn_mode = "running"          # "running" (seed), "sync" (SyncBatchNorm), "local"
    c.bn_momentum = ml_collections.FieldReference(None, field_type=float)  # None: each
    #                                BatchNorm keeps its own (trjax's ResNets 0.9); a float
    #                                sets every BatchNorm's running momentum, yours included
    c.zero_init_residual = False   # built-in ResNets: each residual block's last BatchNorm
    #                                scale starts at 0 (Goyal et al. 2017; flax's ImageNet example)
    # communication
    c.buckets = "two"              # "two" (seed), "tail_minimal", "size:<MB>", "per_leaf"
    c.allreduce = "xla"            # "xla" (psum -> NCCL), "ring", "halving_doubling", "tree",
    #                                "hierarchical" (within a node, then across nodes)
    c.allreduce_local_size = 0     # hierarchical: devices per node (0: devices per process)
    c.compression = "none"         # "none", "bf16", "fp16", "powersgd", "topk"
    c.powersgd_rank = 2
    c.compression_start_step = 0   # all-reduce uncompressed before this step (PowerSGD warm-up)
    c.compression_min_fraction = 0.05  # buckets with a smaller share of |g| are sent exactly
    c.topk_ratio = 0.01
    c.grad_accumulation_steps = 1  # micro-batches per optimizer step (one all-reduce per step)
    c.shard_optimizer_state = False  # ZeRO-1: reduce-scatter, 1/N optimizer state, all-gather
    c.precision = "fp32"           # "fp32", "bf16" (fp32 master weights), "fp16" (dynamic loss scale)
    c.loss_scale_growth_interval = 2000  # fp16: double the loss scale after this many good steps
    # optimisation
    c.optimizer = "sgd"            # "sgd", "lars" or "adamw" (its weight_decay is decoupled,
    #                                times the learning rate: retune both for it)
    c.learning_rate = 0.2
    c.warmup_epochs = 1
    c.momentum = 0.9
    c.nesterov = False
    c.weight_decay = 5e-4
    c.trust_coefficient = 0.001    # LARS only
    c.adam_b1 = 0.9                # adamw only: first-moment decay
    c.adam_b2 = 0.999              # adamw only: second-moment decay
    c.adam_eps = 1e-8              # adamw only: added to the second moment's square root
    c.grad_clip_norm = 0.0         # >0: clip the mean gradient to this global L2 norm before
    #                                the optimizer (the same on every replica); 0: off
    c.ema_decay = 0.0              # >0: also keep ema = d*ema + (1-d)*params after each update
    #                                (in the train state, checkpointed) and evaluate it too
    #                                (val_ema_*); 0: off
    c.label_smoothing = 0.0        # >0: train on (1-e)*onehot + e/K (optax.smooth_labels);
    #                                the evaluation loss stays the plain cross-entropy; 0: off
    c.mixup_alpha = 0.0            # >0: mixup (Zhang et al. 2018), lam ~ Beta(a, a) per
    #                                micro-batch, real rows with real rows only; 0: off
    c.cutmix_alpha = 0.0           # >0: cutmix (Yun et al. 2019); both >0: one of the two per
    #                                micro-batch, probability 1/2 each; 0: off
    c.num_epochs = 15
    # run
    c.seed = 0
    c.halt_on_nonfinite = False    # stop (FloatingPointError) at the first skipped non-finite step
    c.max_consecutive_overflows = 10  # stop after this many non-finite steps in a row at the
    #                                   minimum loss scale (fp16: 1.0; fp32/bf16: always); 0: never
    c.metrics_lag = 1              # host reads step t-1's metrics while step t runs
    c.progress = True              # a progress bar per epoch (only on a terminal)
    c.tensorboard = True           # TensorBoard event files in WORKDIR/tensorboard (when
    #                                tensorboardX is importable; else a note and none)
    c.log_every_steps = 50         # step log (stdout, WORKDIR/steps.jsonl, TensorBoard): loss,
    #                                top-1, img/s, lr, loss scale, skipped steps; 0: off
    c.profile_steps = ""           # "A:B": a jax.profiler trace of steps A..B in WORKDIR/profile
    c.preemption_check_every_steps = 10  # several processes: agree on a SIGTERM/SIGUSR1 stop
    #                                      every N steps (and at epoch ends)
    # checkpoints (orbax, under WORKDIR/checkpoints): after every epoch, and every N steps
    c.checkpoint_every_steps = 0   # 0: at epoch ends only
    c.keep_checkpoints = 3
    c.resume = True                # continue from the newest readable checkpoint in WORKDIR
    c.halt_after_steps = 0         # >0: save and stop after this step (preemption drills, tests)
    c.checkpoint_async = True      # write on a background thread from a host copy of the state;
    #                                False: each save is on disk before the next step
    # compilation (trjax.train.compilation)
    c.compilation_cache = True     # JAX's persistent compilation cache: a second run loads
    #                                what the first compiled; False: off for the process
    c.compilation_cache_dir = ""   # "": a directory set in jax already (JAX_COMPILATION_CACHE_DIR),
    #                                else $XDG_CACHE_HOME/trjax/xla or ~/.cache/trjax/xla
    # multi-host (jax.distributed): see scripts/launch_local.py for N processes on one machine
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator = ""         # "host:port" of process 0
    c.distributed.num_processes = 1
    c.distributed.process_id = 0
    c.distributed.auto = True              # start the run srun / mpirun / JAX_COORDINATOR_ADDRESS
    #                                        describe (trjax.train.distributed.detect_launch)
    c.distributed.heartbeat_timeout_s = 30  # jax's peer timeout; trjax names a dead or stalled
    #                                        peer and exits (code 3) after ~0.3 of this
    c.step_timeout_s = 600.0               # watchdog: exit non-zero if no step finishes this long
    return c
