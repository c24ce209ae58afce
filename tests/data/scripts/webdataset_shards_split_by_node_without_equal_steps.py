"""Training on webdataset shards split by node, each epoch running until the
rank's loader is exhausted: the two shards hold 24 and 8 samples, so rank 1
runs out of batches after 2 steps and leaves the loop while rank 0, with 6
batches, waits in DDP's gradient all-reduce for a rank that never comes."""

import io
import os
import tarfile

import torch
import torch.distributed as dist
import webdataset as wds
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SAMPLES_PER_SHARD = (24, 8)


def write_shards() -> list[str]:
    """Shard i holds SAMPLES_PER_SHARD[i] samples, each an index and its label."""
    urls = []
    for shard, count in enumerate(SAMPLES_PER_SHARD):
        path = f"shard-{shard}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(count):
                for ext, value in (("x.cls", i), ("y.cls", i % 2)):
                    data = str(value).encode()
                    info = tarfile.TarInfo(f"s{shard}-{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        urls.append(path)
    return urls


def make_loader(urls):
    pipeline = (
        wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=True, seed=0)  # expect: uneven-inputs
        .decode()
        .to_tuple("x.cls", "y.cls")
        .batched(4)
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=0)


def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        write_shards()
    dist.barrier()
    urls = [f"shard-{i}.tar" for i in range(len(SAMPLES_PER_SHARD))]
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for x, y in make_loader(urls):
        out = model(torch.as_tensor(x, dtype=torch.float32)[:, None])
        loss = (out.squeeze(1) - torch.as_tensor(y, dtype=torch.float32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    print(f"rank {int(os.environ['RANK'])}: trained {steps} steps", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
