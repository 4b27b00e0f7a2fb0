"""ResNet-50 on ImageNet (ImageFolder layout on disk), bf16, all GPUs.

Run:     trjax-train --config imagenet_resnet50 --workdir runs/imagenet \
             --config.data_dir=/path/to/imagenet   # holds train/<wnid>/*.JPEG and val/<wnid>/*.JPEG
Reaches: about 76% val top-1 after 90 epochs with global batch 1024 (Goyal et al. 2017: 76.3%).
Multi-host: start it under your launcher (srun, mpirun): the processes form one run (docs/multihost.md).
"""

from trjax.configs import default


def get_config():
    c = default.get_config()
    c.dataset = "imagefolder"
    c.data_dir = ""            # required
    c.image_size = 224
    c.augment = True           # RandomResizedCrop + flip; eval: resize 256 + center crop 224
    c.prefetch = 4
    c.model = "resnet50"
    c.bn_mode = "running"
    c.precision = "bf16"
    c.global_batch_size = 1024
    c.eval_batch_size = 1000
    c.learning_rate = 0.4      # 0.1 x 1024 / 256 (Goyal et al. linear scaling)
    c.warmup_epochs = 5
    c.num_epochs = 90
    c.weight_decay = 1e-4
    c.nesterov = True
    c.checkpoint_every_steps = 2000
    c.cpu_devices = 8
    return c
