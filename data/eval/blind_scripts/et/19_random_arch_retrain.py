"""Random-search baseline for the DARTS space: draw a cell genotype at random
(or take a named one) and train the resulting 20-cell network from scratch
on CIFAR-10 with auxiliary head, cutout and drop-path.

    torchrun --nproc_per_node=4 19_random_arch_retrain.py --arch random --data ./data --save eval-random
"""
import argparse
import json
import logging
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as dset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import genotypes
from genotypes import Genotype
from model import NetworkCIFAR
from utils import data_transforms_cifar10, count_parameters_in_MB

OPS_NO_NONE = ["max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3",
               "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5"]


def get_args():
    parser = argparse.ArgumentParser("random-arch-eval")
    parser.add_argument("--data", type=str, default="./data")
    parser.add_argument("--arch", type=str, default="random", help="'random' or a name in genotypes.py")
    parser.add_argument("--batch_size", type=int, default=96, help="per GPU")
    parser.add_argument("--learning_rate", type=float, default=0.025, help="per 96 images")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight_decay", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--init_channels", type=int, default=36)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--auxiliary_weight", type=float, default=0.4)
    parser.add_argument("--cutout_length", type=int, default=16)
    parser.add_argument("--drop_path_prob", type=float, default=0.2)
    parser.add_argument("--grad_clip", type=float, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=str, default="eval-random")
    return parser.parse_args()


def sample_cell(steps=4):
    cell = []
    for i in range(steps):
        inputs = random.sample(range(i + 2), 2)
        for j in inputs:
            cell.append((random.choice(OPS_NO_NONE), j))
    return cell


def sample_random_genotype():
    concat = list(range(2, 6))
    return Genotype(normal=sample_cell(), normal_concat=concat, reduce=sample_cell(), reduce_concat=concat)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # decorrelate cutout / drop-path noise between workers
    set_seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    dist.barrier()
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    fh = logging.FileHandler(os.path.join(args.save, "log.txt")) if rank == 0 else logging.NullHandler()
    logging.getLogger().addHandler(fh)

    genotype = sample_random_genotype() if args.arch == "random" else getattr(genotypes, args.arch)
    logging.info("genotype = %s", genotype)
    if rank == 0:
        with open(os.path.join(args.save, "genotype.json"), "w") as f:
            json.dump(genotype._asdict(), f)

    model = NetworkCIFAR(args.init_channels, 10, args.layers, True, genotype).to(device)
    logging.info("param size = %.2f MB", count_parameters_in_MB(model))
    model = DDP(model, device_ids=[local_rank])

    train_transform, valid_transform = data_transforms_cifar10(args.cutout_length)
    train_data = dset.CIFAR10(root=args.data, train=True, download=False, transform=train_transform)
    valid_data = dset.CIFAR10(root=args.data, train=False, download=False, transform=valid_transform)
    train_sampler = DistributedSampler(train_data, shuffle=True)
    train_queue = DataLoader(train_data, batch_size=args.batch_size, sampler=train_sampler,
                             pin_memory=True, num_workers=4, drop_last=True)
    valid_queue = DataLoader(torch.utils.data.Subset(valid_data, range(rank, len(valid_data), world)),
                             batch_size=256, pin_memory=True, num_workers=4)

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.learning_rate * world, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, float(args.epochs))

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.module.drop_path_prob = args.drop_path_prob * epoch / args.epochs
        model.train()
        train_stats = torch.zeros(3, device=device)
        t0 = time.time()
        for step, (x, y) in enumerate(train_queue):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            logits, logits_aux = model(x)
            loss = criterion(logits, y) + args.auxiliary_weight * criterion(logits_aux, y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            train_stats += torch.stack([loss.detach() * x.size(0), (logits.argmax(1) == y).sum().float(),
                                        torch.tensor(float(x.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(train_stats)

        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in valid_queue:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, _ = model(x)
                counts[0] += (logits.argmax(1) == y).sum()
                counts[1] += y.numel()
        dist.all_reduce(counts)
        valid_acc = (100 * counts[0] / counts[1]).item()
        best_acc = max(best_acc, valid_acc)
        logging.info("epoch %d train_loss %.4f train_acc %.2f valid_acc %.2f best %.2f (%.0fs)", epoch,
                     (train_stats[0] / train_stats[2]).item(), (100 * train_stats[1] / train_stats[2]).item(),
                     valid_acc, best_acc, time.time() - t0)
        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "genotype": genotype._asdict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.save, "weights.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
