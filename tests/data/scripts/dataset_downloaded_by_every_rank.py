"""Every rank downloads CIFAR-10 into ./data at once (dataset-cache-race).

Under torchrun each process runs this file, so four processes fetch and
unpack the same archive into the same folder; one of them reads a file the
others are still writing: "Dataset not found or corrupted", BadZipFile,
EOFError, now and then. The test set below is fetched after rank 0 has
fetched it alone, so only the first call is reported.
"""

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms


def datasets(rank: int):
    to_tensor = transforms.ToTensor()
    train = torchvision.datasets.CIFAR10(  # expect: dataset-cache-race
        "./data", train=True, download=True, transform=to_tensor
    )
    if rank == 0:
        torchvision.datasets.CIFAR10("./data", train=False, download=True)
    dist.barrier()
    test = torchvision.datasets.CIFAR10("./data", train=False, download=True, transform=to_tensor)
    return train, test


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train, _test = datasets(rank)
    loader = DataLoader(train, batch_size=32, sampler=DistributedSampler(train))
    model = DDP(torch.nn.Linear(3 * 32 * 32, 10))
    for images, labels in loader:
        loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
        loss.backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
