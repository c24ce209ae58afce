"""SPOS evolutionary search under a FLOPs budget.

Loads the trained supernet, then runs the evolution of the SPOS paper
(top-k, mutation, crossover). Candidate accuracies are computed with all
GPUs: each rank scores a slice of the validation set.

    torchrun --nproc_per_node=8 06_evo_search_flops.py --data /datasets/imagenet \
        --supernet output/spos/supernet_last.pth --max-flops 330
"""
import argparse
import logging
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

from spos.network import SPOSSuperNet, NUM_LAYERS, NUM_CHOICES
from spos.flops import get_cand_flops

log = logging.getLogger("evo")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--supernet", required=True)
    parser.add_argument("--max-flops", type=float, default=330e6)
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--select-num", type=int, default=10)
    parser.add_argument("--population-num", type=int, default=50)
    parser.add_argument("--m-prob", type=float, default=0.1)
    parser.add_argument("--crossover-num", type=int, default=25)
    parser.add_argument("--mutation-num", type=int, default=25)
    parser.add_argument("--recalib-batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-dir", default="./log_search")
    args = parser.parse_args()
    if args.max_flops < 1e4:
        args.max_flops *= 1e6
    return args


class EvolutionSearcher:
    def __init__(self, args, model, recalib_data, val_loader, device):
        self.args = args
        self.model = model
        self.recalib_data = recalib_data
        self.val_loader = val_loader
        self.device = device
        self.vis_dict = {}
        self.keep_top_k = {args.select_num: [], 50: []}
        self.candidates = []
        self.rng = random.Random(args.seed)
        self.epoch = 0

    def is_legal(self, cand):
        info = self.vis_dict.setdefault(cand, {})
        if "visited" in info:
            return False
        info["flops"] = get_cand_flops(cand)
        if info["flops"] > self.args.max_flops:
            return False
        info["err"] = self.evaluate(cand)
        info["visited"] = True
        return True

    @torch.no_grad()
    def recalibrate(self, cand):
        for m in self.model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.zero_()
                m.running_var.fill_(1)
                m.momentum = None
                m.num_batches_tracked.zero_()
        self.model.train()
        for images in self.recalib_data:
            self.model(images, cand)

    @torch.no_grad()
    def evaluate(self, cand):
        self.recalibrate(cand)
        self.model.eval()
        correct, total = 0, 0
        for images, target in self.val_loader:
            images = images.to(self.device, non_blocking=True)
            target = target.to(self.device, non_blocking=True)
            logits = self.model(images, cand)
            correct += (logits.argmax(1) == target).sum().item()
            total += target.size(0)
        counts = torch.tensor([correct, total], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return 1.0 - (counts[0] / counts[1]).item()

    def update_top_k(self, candidates, k, key):
        t = self.keep_top_k[k]
        t += candidates
        t.sort(key=key)
        self.keep_top_k[k] = t[:k]

    def random_cand(self):
        return tuple(self.rng.randrange(NUM_CHOICES) for _ in range(NUM_LAYERS))

    def get_random(self, num):
        while len(self.candidates) < num:
            cand = self.random_cand()
            if self.is_legal(cand):
                self.candidates.append(cand)

    def get_mutation(self, k, num, m_prob, max_iters=10):
        res, it = [], 0
        while len(res) < num and it < max_iters * num:
            it += 1
            cand = list(self.rng.choice(self.keep_top_k[k]))
            for i in range(NUM_LAYERS):
                if self.rng.random() < m_prob:
                    cand[i] = self.rng.randrange(NUM_CHOICES)
            cand = tuple(cand)
            if self.is_legal(cand):
                res.append(cand)
        return res

    def get_crossover(self, k, num, max_iters=10):
        res, it = [], 0
        while len(res) < num and it < max_iters * num:
            it += 1
            p1 = self.rng.choice(self.keep_top_k[k])
            p2 = self.rng.choice(self.keep_top_k[k])
            cand = tuple(self.rng.choice([a, b]) for a, b in zip(p1, p2))
            if self.is_legal(cand):
                res.append(cand)
        return res

    def save_checkpoint(self):
        if dist.get_rank() != 0:
            return
        os.makedirs(self.args.log_dir, exist_ok=True)
        with open(os.path.join(self.args.log_dir, "checkpoint.pkl"), "wb") as f:
            pickle.dump({"vis_dict": self.vis_dict, "keep_top_k": self.keep_top_k,
                         "candidates": self.candidates, "epoch": self.epoch}, f)

    def search(self):
        a = self.args
        self.get_random(a.population_num)
        while self.epoch < a.max_epochs:
            t0 = time.time()
            self.update_top_k(self.candidates, a.select_num, key=lambda c: self.vis_dict[c]["err"])
            self.update_top_k(self.candidates, 50, key=lambda c: self.vis_dict[c]["err"])
            log.info("epoch %d top-%d:", self.epoch, len(self.keep_top_k[50]))
            for i, cand in enumerate(self.keep_top_k[50][:10]):
                info = self.vis_dict[cand]
                log.info("  no.%d %s top1 err %.4f flops %.1fM", i + 1, cand, info["err"], info["flops"] / 1e6)
            mutation = self.get_mutation(a.select_num, a.mutation_num, a.m_prob)
            crossover = self.get_crossover(a.select_num, a.crossover_num)
            self.candidates = mutation + crossover
            self.get_random(a.population_num)
            self.epoch += 1
            self.save_checkpoint()
            log.info("epoch time %.1fs", time.time() - t0)
        return self.keep_top_k[50][0]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                             transforms.ToTensor(), normalize])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), tf)

    # identical recalibration images on every rank -> identical BN statistics
    g = np.random.RandomState(args.seed)
    recalib_idx = g.choice(len(train_set), args.recalib_batches * args.batch_size, replace=False)
    recalib_loader = DataLoader(Subset(train_set, recalib_idx.tolist()), batch_size=args.batch_size,
                                shuffle=False, num_workers=8, pin_memory=True)
    recalib_data = [x.to(device) for x, _ in recalib_loader]

    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))),
                            batch_size=args.batch_size, shuffle=False, num_workers=8, pin_memory=True)

    model = SPOSSuperNet()
    state = torch.load(args.supernet, map_location="cpu")["model"]
    model.load_state_dict(state)
    model.to(device)

    searcher = EvolutionSearcher(args, model, recalib_data, val_loader, device)
    best = searcher.search()
    log.info("best candidate %s err %.4f", best, searcher.vis_dict[best]["err"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
