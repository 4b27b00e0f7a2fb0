"""ResNet-20 on CIFAR-10 (He et al. 2016, section 4.2), data parallel with SyncBatchNorm.

Run:     trjax-train --config cifar10_resnet20 --workdir runs/cifar10 \
             --config.data_dir=/path/to/cifar-10-batches-py
Reaches: about 91-92% val top-1 after 160 epochs (He et al. report 91.25%); a GPU run.
Try it:  trjax-tiny-cifar runs/tiny_cifar  (a tiny data set in the real format),
         then --config.data_dir=runs/tiny_cifar --config.num_epochs=4 --config.model=resnet8
"""

from trjax.configs import default


def get_config():
    c = default.get_config()
    c.dataset = "cifar10"
    c.data_dir = ""            # required: the extracted cifar-10-batches-py (or its parent)
    c.augment = True           # 4-pixel padded random crop + horizontal flip
    c.model = "resnet20"
    c.bn_mode = "sync"
    c.global_batch_size = 128
    c.eval_batch_size = 1000
    c.learning_rate = 0.1
    c.warmup_epochs = 2
    c.num_epochs = 160
    c.weight_decay = 1e-4
    c.checkpoint_every_steps = 1000
    return c
