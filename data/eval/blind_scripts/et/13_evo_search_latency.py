"""Latency-constrained evolutionary search on a trained BigNAS-style supernet.

Latency of a child is looked up in a per-op latency table measured on the
target phone. Accuracy is measured on a 10k-image minival split of the
ImageNet train set, sharded over all GPUs.

    torchrun --nproc_per_node=8 13_evo_search_latency.py --cfg configs/search_pixel1_80ms.yaml
"""
import argparse
import copy
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader, Subset

from supernet.models import AttentiveSuperNet
from supernet.data import build_train_dataset
from supernet.bn import recalibrate_bn_stats

logger = logging.getLogger("evo")


class LatencyTable:
    def __init__(self, path):
        with open(path) as f:
            self.table = json.load(f)

    def predict(self, arch):
        total = self.table["stem"] + self.table["head"][str(arch["resolution"])]
        for i, (k, e, w) in enumerate(zip(arch["kernel"], arch["expand"], arch["width"])):
            if i >= sum(arch["depth"]):
                break
            total += self.table["blocks"][f"r{arch['resolution']}_k{k}_e{e}_w{w}"]
        return total


def sample_arch(space):
    n = space["max_blocks"]
    return {
        "resolution": random.choice(space["resolution"]),
        "depth": [random.choice(d) for d in space["depth"]],
        "kernel": [random.choice(space["kernel"]) for _ in range(n)],
        "expand": [random.choice(space["expand"]) for _ in range(n)],
        "width": [random.choice(space["width"]) for _ in range(n)],
    }


def mutate(arch, space, p):
    child = copy.deepcopy(arch)
    if random.random() < p:
        child["resolution"] = random.choice(space["resolution"])
    for key in ("kernel", "expand", "width"):
        for i in range(len(child[key])):
            if random.random() < p:
                child[key][i] = random.choice(space[key])
    for i, d in enumerate(space["depth"]):
        if random.random() < p:
            child["depth"][i] = random.choice(d)
    return child


def crossover(a, b):
    child = {}
    for key in a:
        if isinstance(a[key], list):
            child[key] = [random.choice(pair) for pair in zip(a[key], b[key])]
        else:
            child[key] = random.choice([a[key], b[key]])
    return child


def arch_key(arch):
    return json.dumps(arch, sort_keys=True)


@torch.no_grad()
def evaluate(supernet, arch, calib_loader, minival_loader, device):
    supernet.set_active_subnet(arch)
    subnet = supernet.get_active_subnet().to(device)
    recalibrate_bn_stats(subnet, calib_loader, resolution=arch["resolution"], device=device)
    subnet.eval()
    hits = torch.zeros(2, device=device)
    for images, labels in minival_loader:
        images = torch.nn.functional.interpolate(images.to(device, non_blocking=True), size=arch["resolution"],
                                                 mode="bilinear", align_corners=False)
        labels = labels.to(device, non_blocking=True)
        hits[0] += (subnet(images).argmax(1) == labels).sum()
        hits[1] += labels.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def generate(pool, n, make, latency, budget, max_tries):
    out, tries = [], 0
    while len(out) < n and tries < max_tries:
        tries += 1
        cand = make()
        if latency.predict(cand) <= budget and arch_key(cand) not in pool:
            out.append(cand)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"])

    train_set = build_train_dataset(cfg["data_root"], eval_transform=True, size=max(cfg["space"]["resolution"]))
    perm = np.random.RandomState(cfg["seed"]).permutation(len(train_set))
    calib_idx = perm[:cfg["calib_images"]].tolist()
    minival_idx = perm[cfg["calib_images"]:cfg["calib_images"] + cfg["minival_images"]].tolist()
    calib_loader = DataLoader(Subset(train_set, calib_idx), batch_size=128, shuffle=False, num_workers=8)
    minival_loader = DataLoader(Subset(train_set, minival_idx[rank::world]), batch_size=250, shuffle=False,
                                num_workers=8, pin_memory=True)

    supernet = AttentiveSuperNet.from_config(cfg["supernet_cfg"])
    ckpt = torch.load(cfg["supernet_ckpt"], map_location="cpu")
    supernet.load_state_dict(ckpt["model"])
    supernet.to(device).eval()

    latency = LatencyTable(cfg["latency_table"])
    space, budget = cfg["space"], cfg["latency_budget_ms"]
    pop_size, parents_n = cfg["population"], cfg["parents"]
    n_mut = int(pop_size * cfg["mutate_ratio"])
    max_tries = cfg.get("max_tries", 1000)

    scored = {}
    population = generate(scored, pop_size, lambda: sample_arch(space), latency, budget, max_tries)
    history = []
    for gen in range(cfg["generations"]):
        t0 = time.time()
        for arch in population:
            key = arch_key(arch)
            if key not in scored:
                scored[key] = (evaluate(supernet, arch, calib_loader, minival_loader, device), arch)
        ranked = sorted((scored[arch_key(a)] for a in population), key=lambda t: -t[0])
        parents = [a for _, a in ranked[:parents_n]]
        history.append({"gen": gen, "top1": ranked[0][0], "lat": latency.predict(ranked[0][1])})
        logger.info("gen %d best %.4f (%.1f ms) evaluated %d in %.0fs", gen, ranked[0][0],
                    latency.predict(ranked[0][1]), len(scored), time.time() - t0)

        mutants = generate(scored, n_mut, lambda: mutate(random.choice(parents), space, cfg["mutate_prob"]),
                           latency, budget, max_tries)
        children = generate(scored, pop_size - parents_n - len(mutants),
                            lambda: crossover(random.choice(parents), random.choice(parents)),
                            latency, budget, max_tries)
        population = parents + mutants + children

    best_acc, best_arch = max(scored.values(), key=lambda t: t[0])
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "best_arch.json"), "w") as f:
            json.dump({"acc": best_acc, "latency_ms": latency.predict(best_arch), "arch": best_arch,
                       "history": history}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
