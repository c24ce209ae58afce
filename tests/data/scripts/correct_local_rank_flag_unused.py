"""The flag only swallows what a launcher passes; the rank comes from LOCAL_RANK in a helper.

Reduced from facebookresearch/mae main_pretrain.py (the rank is read in util/misc.py
init_distributed_mode). No finding expected.
"""

import argparse

import torch
from util import misc


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("pre-training", add_help=False)
    parser.add_argument("--local-rank", "--local_rank", default=-1, type=int)
    parser.add_argument("--dist_url", default="env://")
    return parser


def main(args: argparse.Namespace) -> None:
    misc.init_distributed_mode(args)
    model = torch.nn.Linear(4, 4).to(torch.device("cuda", args.gpu))
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])


if __name__ == "__main__":
    main(get_args_parser().parse_args())
