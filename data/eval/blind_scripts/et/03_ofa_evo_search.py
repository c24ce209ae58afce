"""Evolutionary search over sub-networks of a trained once-for-all supernet.

Every candidate is evaluated by all ranks together: BN statistics are
recalibrated on a fixed calibration set, then each rank scores its shard of
the held-out set and the counts are summed. The population lives on rank 0
and is broadcast to the other ranks each generation.

    torchrun --nproc_per_node=8 03_ofa_evo_search.py \
        --data /datasets/imagenet --supernet ckpt/ofa_mbv3_supernet.pth --flops 300
"""
import argparse
import copy
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

from ofa_lib.networks import OFAMobileNetV3
from ofa_lib.utils import count_flops

KS_LIST = [3, 5, 7]
EXPAND_LIST = [3, 4, 6]
DEPTH_LIST = [2, 3, 4]
NUM_STAGES = 5


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--supernet", required=True)
    p.add_argument("--flops", type=float, default=300.0, help="MFLOPs budget")
    p.add_argument("--population", type=int, default=100)
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--parents", type=int, default=25)
    p.add_argument("--mutate-prob", type=float, default=0.1)
    p.add_argument("--mutation-ratio", type=float, default=0.5)
    p.add_argument("--calib-images", type=int, default=2000)
    p.add_argument("--holdout", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="./search_out")
    return p.parse_args()


def random_arch(rng):
    depths = [rng.choice(DEPTH_LIST) for _ in range(NUM_STAGES)]
    n = NUM_STAGES * max(DEPTH_LIST)
    return {"ks": [rng.choice(KS_LIST) for _ in range(n)],
            "e": [rng.choice(EXPAND_LIST) for _ in range(n)],
            "d": depths}


def mutate(arch, rng, prob):
    child = copy.deepcopy(arch)
    for i in range(len(child["ks"])):
        if rng.random() < prob:
            child["ks"][i] = rng.choice(KS_LIST)
        if rng.random() < prob:
            child["e"][i] = rng.choice(EXPAND_LIST)
    for i in range(NUM_STAGES):
        if rng.random() < prob:
            child["d"][i] = rng.choice(DEPTH_LIST)
    return child


def crossover(a, b, rng):
    return {k: [rng.choice(pair) for pair in zip(a[k], b[k])] for k in a}


def load_supernet(path):
    net = OFAMobileNetV3(ks_list=KS_LIST, expand_ratio_list=EXPAND_LIST, depth_list=DEPTH_LIST)
    ckpt = torch.load(path, map_location="cpu")
    state = ckpt.get("state_dict", ckpt)
    # checkpoints written from the DDP wrapper carry a "module." prefix
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    net.load_state_dict(state)
    return net


@torch.no_grad()
def recalibrate_bn(net, calib_batches):
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average
    net.train()
    for images in calib_batches:
        net(images)
    net.eval()


@torch.no_grad()
def evaluate(net, loader, device):
    counts = torch.zeros(2, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        counts[0] += (net(images).argmax(1) == target).sum()
        counts[1] += target.numel()
    dist.all_reduce(counts)
    return (100.0 * counts[0] / counts[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), normalize])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), eval_tf)

    # Same split on every rank: fixed generator, not the global RNG.
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(train_set), generator=g).tolist()
    calib_idx = perm[:args.calib_images]
    holdout_idx = perm[args.calib_images:args.calib_images + args.holdout]

    # Every rank recalibrates on the same images, so BN statistics agree.
    calib_loader = DataLoader(Subset(train_set, calib_idx), batch_size=100, shuffle=False,
                              num_workers=args.workers, pin_memory=True)
    calib_batches = [x.to(device) for x, _ in calib_loader]

    # Unpadded shard of the held-out images for each rank.
    holdout_shard = holdout_idx[rank::world]
    holdout_loader = DataLoader(Subset(train_set, holdout_shard), batch_size=args.batch_size,
                                shuffle=False, num_workers=args.workers, pin_memory=True)

    supernet = load_supernet(args.supernet).to(device)
    supernet.eval()

    def score(arch):
        supernet.set_active_subnet(ks=arch["ks"], e=arch["e"], d=arch["d"])
        subnet = supernet.get_active_subnet(preserve_weight=True).to(device)
        recalibrate_bn(subnet, calib_batches)
        return evaluate(subnet, holdout_loader, device)

    def flops_ok(arch):
        supernet.set_active_subnet(ks=arch["ks"], e=arch["e"], d=arch["d"])
        return count_flops(supernet.get_active_subnet(preserve_weight=False), (1, 3, 224, 224)) / 1e6 <= args.flops

    rng = random.Random(args.seed)
    population = None
    if rank == 0:
        population = []
        while len(population) < args.population:
            a = random_arch(rng)
            if flops_ok(a):
                population.append(a)
    history = []
    best = (0.0, None)
    n_mut = int(round(args.population * args.mutation_ratio))

    for gen in range(args.generations):
        t0 = time.time()
        box = [population]
        dist.broadcast_object_list(box, src=0)
        population = box[0]

        accs = [score(a) for a in population]
        scored = sorted(zip(accs, population), key=lambda t: -t[0])
        if scored[0][0] > best[0]:
            best = scored[0]
        history.append({"generation": gen, "best": best[0], "mean_top": sum(a for a, _ in scored[:args.parents]) / args.parents})

        if rank == 0:
            print(f"gen {gen}: best {best[0]:.2f} ({time.time() - t0:.0f}s)", flush=True)
            parents = [a for _, a in scored[:args.parents]]
            children = []
            while len(children) < n_mut:
                c = mutate(rng.choice(parents), rng, args.mutate_prob)
                if flops_ok(c):
                    children.append(c)
            while len(children) < args.population - args.parents:
                c = crossover(rng.choice(parents), rng.choice(parents), rng)
                if flops_ok(c):
                    children.append(c)
            population = parents + children

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "search_result.json"), "w") as f:
            json.dump({"best_acc": best[0], "best_arch": best[1], "history": history}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
