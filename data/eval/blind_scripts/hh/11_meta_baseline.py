#!/usr/bin/env python3
"""Meta-Baseline, meta stage (Chen et al. 2021): cosine-similarity prototypes with a
learnable temperature, initialised from a Classifier-Baseline encoder.

Episodes are generated independently on every GPU; validation and the final
few-shot test split their episodes evenly over the GPUs.

    torchrun --nproc_per_node=4 11_meta_baseline.py --config configs/meta_mini_r12.yaml
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

logger = logging.getLogger("meta_baseline")


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("n_way", 5)
    cfg.setdefault("n_shot", 1)
    cfg.setdefault("n_query", 15)
    cfg.setdefault("train_batches", 200)
    cfg.setdefault("val_episodes", 600)
    cfg.setdefault("test_episodes", 2000)
    cfg.setdefault("max_epoch", 20)
    cfg.setdefault("lr", 1e-3)
    cfg.setdefault("temp", 10.0)
    cfg.setdefault("workers", 8)
    cfg["save_path"] = os.path.join("save", a.name or os.path.splitext(os.path.basename(a.config))[0])
    return cfg


class MiniImageNetPacked(Dataset):
    """Reads the packed miniImageNet pickles {'data': [N,84,84,3] uint8, 'labels': [N]}."""

    def __init__(self, root, split, augment=False):
        import pickle
        with open(os.path.join(root, f"miniImageNet_category_split_{split}.pickle"), "rb") as f:
            pack = pickle.load(f, encoding="latin1")
        self.data = pack["data"]
        labels = pack["labels"]
        min_label = min(labels)
        self.label = np.array([x - min_label for x in labels])
        norm = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        if augment:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.RandomResizedCrop(80),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.Resize(92),
                                          transforms.CenterCrop(80), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.tf(self.data[i]), self.label[i]


class EpisodeSampler:
    def __init__(self, label, n_batch, n_way, n_per, seed):
        self.catlocs = [np.flatnonzero(label == c) for c in range(label.max() + 1)]
        self.n_batch, self.n_way, self.n_per = n_batch, n_way, n_per
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        for _ in range(self.n_batch):
            classes = self.rng.choice(len(self.catlocs), self.n_way, replace=False)
            episode = [self.rng.choice(self.catlocs[c], self.n_per, replace=False) for c in classes]
            yield np.stack(episode).reshape(-1).tolist()  # class-major: [way, shot+query]


def conv3x3(i, o):
    return nn.Conv2d(i, o, 3, 1, 1, bias=False)


class Block(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.c1, self.b1 = conv3x3(i, o), nn.BatchNorm2d(o)
        self.c2, self.b2 = conv3x3(o, o), nn.BatchNorm2d(o)
        self.c3, self.b3 = conv3x3(o, o), nn.BatchNorm2d(o)
        self.down = nn.Sequential(nn.Conv2d(i, o, 1, bias=False), nn.BatchNorm2d(o))
        self.act = nn.LeakyReLU(0.1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        out = self.act(self.b1(self.c1(x)))
        out = self.act(self.b2(self.c2(out)))
        out = self.b3(self.c3(out))
        return self.pool(self.act(out + self.down(x)))


class ResNet12(nn.Module):
    def __init__(self, ch=(64, 128, 256, 512)):
        super().__init__()
        self.layer1, self.layer2 = Block(3, ch[0]), Block(ch[0], ch[1])
        self.layer3, self.layer4 = Block(ch[1], ch[2]), Block(ch[2], ch[3])
        self.out_dim = ch[3]

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return x.mean(dim=(2, 3))


class MetaBaseline(nn.Module):
    def __init__(self, temp):
        super().__init__()
        self.encoder = ResNet12()
        self.temp = nn.Parameter(torch.tensor(float(temp)))

    def forward(self, x, n_way, n_shot):
        feat = self.encoder(x).view(n_way, -1, self.encoder.out_dim)
        support, query = feat[:, :n_shot], feat[:, n_shot:].reshape(-1, self.encoder.out_dim)
        protos = F.normalize(support.mean(1), dim=-1)
        return self.temp * F.normalize(query, dim=-1) @ protos.t()


def mean_confidence_interval(accs):
    a = np.asarray(accs, dtype=np.float64)
    return a.mean(), 1.96 * a.std() / math.sqrt(len(a))


@torch.no_grad()
def fewshot_eval(model, loader, cfg, device):
    model.eval()
    y = torch.arange(cfg["n_way"], device=device).repeat_interleave(cfg["n_query"])
    accs = []
    for x, _ in loader:
        logits = model(x.to(device, non_blocking=True), cfg["n_way"], cfg["n_shot"])
        accs.append((logits.argmax(1) == y).float().mean().item())
    return accs


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    per = cfg["n_shot"] + cfg["n_query"]

    train_set = MiniImageNetPacked(cfg["root"], "train", augment=cfg.get("augment", False))
    val_set = MiniImageNetPacked(cfg["root"], "val")
    test_set = MiniImageNetPacked(cfg["root"], "test")
    train_loader = DataLoader(train_set, batch_sampler=EpisodeSampler(
        train_set.label, cfg["train_batches"] // world, cfg["n_way"], per, seed=rank * 31 + 1),
        num_workers=cfg["workers"], pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=EpisodeSampler(
        val_set.label, cfg["val_episodes"] // world, cfg["n_way"], per, seed=1000 + rank),
        num_workers=cfg["workers"], pin_memory=True)
    test_loader = DataLoader(test_set, batch_sampler=EpisodeSampler(
        test_set.label, cfg["test_episodes"] // world, cfg["n_way"], per, seed=2000 + rank),
        num_workers=cfg["workers"], pin_memory=True)

    model = MetaBaseline(cfg["temp"])
    enc = torch.load(cfg["classifier_baseline_ckpt"], map_location="cpu")["encoder"]
    model.encoder.load_state_dict(enc)
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, weight_decay=5e-4)
    if rank == 0:
        os.makedirs(cfg["save_path"], exist_ok=True)
        with open(os.path.join(cfg["save_path"], "config.yaml"), "w") as f:
            yaml.dump(cfg, f)

    y = torch.arange(cfg["n_way"], device=device).repeat_interleave(cfg["n_query"])
    best_va = 0.0
    for epoch in range(1, cfg["max_epoch"] + 1):
        model.train()
        t0 = time.time()
        tl = torch.zeros(3, device=device)
        for x, _ in train_loader:
            logits = model(x.to(device, non_blocking=True), cfg["n_way"], cfg["n_shot"])
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tl += torch.stack([loss.detach(), (logits.argmax(1) == y).float().mean(), torch.ones_like(loss)])
        dist.all_reduce(tl)

        val_accs = fewshot_eval(model, val_loader, cfg, device)
        if rank == 0:
            va, va_ci = mean_confidence_interval(val_accs)
            logger.info("epoch %d, train loss %.4f acc %.4f, val %.4f +- %.4f, temp %.2f, %.0fs", epoch,
                        (tl[0] / tl[2]).item(), (tl[1] / tl[2]).item(), va, va_ci,
                        model.module.temp.item(), time.time() - t0)
            torch.save({"epoch": epoch, "model": model.module.state_dict()},
                       os.path.join(cfg["save_path"], "epoch-last.pth"))
            if va > best_va:
                best_va = va
                torch.save({"epoch": epoch, "model": model.module.state_dict()},
                           os.path.join(cfg["save_path"], "max-va.pth"))
        dist.barrier()

    best = torch.load(os.path.join(cfg["save_path"], "max-va.pth"), map_location=device)
    model.module.load_state_dict(best["model"])
    test_accs = fewshot_eval(model, test_loader, cfg, device)
    if rank == 0:
        acc, ci = mean_confidence_interval(test_accs)
        logger.info("test %d-way %d-shot (epoch %d): %.2f +- %.2f", cfg["n_way"], cfg["n_shot"],
                    best["epoch"], 100 * acc, 100 * ci)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
