"""Every rank resumes from a checkpoint with torch.load and no map_location.

torchrun --nproc_per_node=4 checkpoint_loaded_without_map_location.py --resume last.pt
The checkpoint was saved from rank 0's GPU, so each rank's copy lands on cuda:0.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    parser.add_argument("--pretrained", default="backbone.pt")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = nn.Linear(8, 2).cuda(local_rank)
    # map_location on the pretrained weights says nothing of the resume below
    model.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    if args.resume:
        checkpoint = torch.load(args.resume)  # expect: checkpoint-map-location
        model.load_state_dict(checkpoint["model"])
    model = DDP(model, device_ids=[local_rank])
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
