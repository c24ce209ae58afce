"""The process group and the device come from the repository's own helper.

Many research repositories (DETR, DINO, MAE, YOLO ports) call a helper such as
init_distributed_mode(args), kept in another file, which runs
init_process_group and torch.cuda.set_device(args.gpu). This file alone shows
neither, so `.cuda()` and dist.get_rank() are not reported. The helper's
package name starts with "torch" on purpose: it is still not torch's own.
Lint only; the helper module is not part of this repository.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchkit_recipes import misc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    misc.init_distributed_mode(args)  # sets args.gpu, the group and the device
    model = nn.Linear(16, 4).cuda()
    model = DDP(model, device_ids=[args.gpu])
    batch = torch.randn(8, 16).cuda()
    loss = model(batch).sum()
    loss.backward()
    if dist.get_rank() == 0:
        print("loss", loss.item())


if __name__ == "__main__":
    main()
