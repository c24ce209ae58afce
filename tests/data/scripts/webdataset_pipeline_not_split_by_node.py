"""A webdataset training pipeline in a DDP script with no node splitter:
every rank reads every shard, so the ranks train on the same samples and an
epoch holds N times the data (a DistributedSampler cannot cut a stream).

torchrun --nproc_per_node=8 webdataset_pipeline_not_split_by_node.py
"""

import os

import torch
import torch.distributed as dist
import webdataset as wds
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SHARDS = "/data/train-{000000..001023}.tar"


def make_loader(batch_size):
    pipeline = wds.DataPipeline(  # expect: missing-distributed-sampler
        wds.SimpleShardList(SHARDS),
        wds.shuffle(100),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(5000),
        wds.decode("torchrgb"),
        wds.to_tuple("jpg", "cls"),
        wds.batched(batch_size),
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=4)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(8, 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for images, labels in make_loader(32):
        loss = model(images.flatten(1)[:, :8].cuda(local_rank)).squeeze(-1)
        loss = (loss - labels.float().cuda(local_rank)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
