"""An FFCV training loader under torchrun without distributed=True
(missing-distributed-sampler).

FFCV's Loader splits a .beton file between the processes only when it is told
distributed=True: here every rank walks the whole training set in its own
random order, N times the work per epoch, while the validation loader beside
it is split.
"""

import os

import torch
import torch.distributed as dist
from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import ToTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    pipelines = {"image": [SimpleRGBImageDecoder(), ToTensor()], "label": [IntDecoder()]}
    train = Loader(  # expect: missing-distributed-sampler
        "train.beton", batch_size=64, num_workers=4, order=OrderOption.RANDOM, pipelines=pipelines
    )
    val = Loader(
        "val.beton",
        batch_size=64,
        num_workers=4,
        order=OrderOption.SEQUENTIAL,
        pipelines=pipelines,
        distributed=True,
    )
    model = DDP(torch.nn.Linear(8, 2).cuda(), device_ids=[local_rank])
    for images, labels in train:
        model(images.float().flatten(1)[:, :8]).sum().backward()
    del model, val  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
