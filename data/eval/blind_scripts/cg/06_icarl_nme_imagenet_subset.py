"""Class-incremental ImageNet-Subset (100 classes, 50 base + 5 x 10) with herding exemplars
and a nearest-mean-of-exemplars classifier.

Feature extraction for herding is spread over all GPUs: every rank embeds a slice of the
class's images, the slices are gathered and every rank runs the (deterministic) herding.

    torchrun --nproc_per_node=8 06_icarl_nme_imagenet_subset.py --cfg configs/in100_b50_5s.json
"""
import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

DEFAULTS = dict(root="/datasets/imagenet_subset", out="runs/icarl_in100", base=50, inc=10,
                epochs=90, batch=32, lr=0.1, wd=1e-4, T=2.0, mem=2000, workers=8, seed=1993)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local = int(os.environ["LOCAL_RANK"])
        self.dev = torch.device("cuda", self.local)
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.train_ds = datasets.ImageFolder(os.path.join(cfg["root"], "train"), transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), norm]))
        plain = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                    transforms.ToTensor(), norm])
        self.embed_ds = datasets.ImageFolder(os.path.join(cfg["root"], "train"), plain)
        self.val_ds = datasets.ImageFolder(os.path.join(cfg["root"], "val"), plain)
        self.y_train = np.asarray(self.train_ds.targets)
        self.y_val = np.asarray(self.val_ds.targets)

        self.backbone = models.resnet18()
        self.backbone.fc = nn.Identity()
        self.backbone.to(self.dev)
        self.head = None
        self.old = None
        self.memory = {}
        self.class_means = None

    # ---------------------------------------------------------------- model
    def grow_head(self, n_new):
        old = self.head
        n_old = 0 if old is None else old.out_features
        head = nn.Linear(512, n_old + n_new).to(self.dev)
        if old is not None:
            head.weight.data[:n_old].copy_(old.weight.data)
            head.bias.data[:n_old].copy_(old.bias.data)
        self.head = head
        return n_old

    def network(self):
        return nn.Sequential(self.backbone, self.head)

    # ----------------------------------------------------------- exemplars
    @torch.no_grad()
    def embed_class(self, c):
        idx = np.flatnonzero(self.y_train == c)
        mine = idx[self.rank::self.world]
        loader = DataLoader(Subset(self.embed_ds, mine), batch_size=128,
                            num_workers=self.cfg["workers"])
        self.backbone.eval()
        feats = torch.cat([F.normalize(self.backbone(x.to(self.dev)), dim=1) for x, _ in loader])
        mine_t = torch.as_tensor(mine, device=self.dev)
        all_feats = [torch.empty_like(feats) for _ in range(self.world)]
        all_idx = [torch.empty_like(mine_t) for _ in range(self.world)]
        dist.all_gather(all_feats, feats)
        dist.all_gather(all_idx, mine_t)
        return torch.cat(all_feats), torch.cat(all_idx).cpu().numpy()

    @staticmethod
    def herd(feats, m):
        mu = feats.mean(0)
        acc = torch.zeros_like(mu)
        picked = []
        for k in range(1, min(m, len(feats)) + 1):
            gap = torch.norm(mu - (acc + feats) / k, dim=1)
            if picked:
                gap[picked] = float("inf")
            i = int(torch.argmin(gap))
            picked.append(i)
            acc += feats[i]
        return picked

    def rebuild_memory(self, n_seen, new_classes):
        m = self.cfg["mem"] // n_seen
        for c in self.memory:
            self.memory[c] = self.memory[c][:m]
        for c in new_classes:
            feats, idx = self.embed_class(c)
            self.memory[c] = idx[self.herd(feats, m)].tolist()
        means = []
        for c in range(n_seen):
            feats, idx = self.embed_class(c)
            pos = {int(v): i for i, v in enumerate(idx)}
            sel = [pos[i] for i in self.memory[c]]
            means.append(F.normalize(feats[sel].mean(0), dim=0))
        self.class_means = torch.stack(means)

    # ---------------------------------------------------------------- train
    def train_task(self, task, lo, hi):
        cfg = self.cfg
        n_old = self.grow_head(hi - lo)
        model = DDP(self.network(), device_ids=[self.local])
        idx = np.flatnonzero((self.y_train >= lo) & (self.y_train < hi)).tolist()
        idx += [i for c in sorted(self.memory) for i in self.memory[c]]
        ds = Subset(self.train_ds, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"] + task)
        loader = DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=cfg["workers"],
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, weight_decay=cfg["wd"])
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg["epochs"])
        T = cfg["T"]
        for ep in range(cfg["epochs"]):
            model.train()
            sampler.set_epoch(ep)
            tic, tot = time.time(), 0.0
            for x, y in loader:
                x, y = x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)
                out = model(x)
                loss = F.cross_entropy(out, y)
                if self.old is not None:
                    with torch.no_grad():
                        o = self.old(x)
                    loss = loss + F.kl_div(F.log_softmax(out[:, :n_old] / T, 1),
                                           F.softmax(o / T, 1), reduction="batchmean") * T * T
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += loss.item()
            sched.step()
            if self.rank == 0:
                print(f"[t{task}] ep {ep:3d} loss {tot / len(loader):.4f} ({time.time() - tic:.0f}s)",
                      flush=True)
        self.old = copy.deepcopy(self.network()).eval().requires_grad_(False)

    @torch.no_grad()
    def evaluate(self, bounds, upto):
        """Returns per-task CNN and NME accuracy; each rank scores a disjoint slice."""
        self.backbone.eval()
        net = self.network().eval()
        res = []
        for j in range(upto + 1):
            lo, hi = bounds[j], bounds[j + 1]
            idx = np.flatnonzero((self.y_val >= lo) & (self.y_val < hi))[self.rank::self.world]
            loader = DataLoader(Subset(self.val_ds, idx), batch_size=128, num_workers=4)
            s = torch.zeros(3, device=self.dev)
            for x, y in loader:
                x, y = x.to(self.dev), y.to(self.dev)
                f = F.normalize(self.backbone(x), dim=1)
                s[0] += (net(x).argmax(1) == y).sum()
                s[1] += ((f @ self.class_means.T).argmax(1) == y).sum()
                s[2] += len(y)
            dist.all_reduce(s)
            res.append(((100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()))
        return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        cfg.update(json.load(open(a.cfg)))

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(cfg["seed"])
    tr = Trainer(cfg)
    n_cls = len(tr.train_ds.classes)
    bounds = [0] + list(range(cfg["base"], n_cls + 1, cfg["inc"]))
    n_tasks = len(bounds) - 1
    cnn_acc, nme_acc = np.zeros((n_tasks, n_tasks)), np.zeros((n_tasks, n_tasks))

    for task in range(n_tasks):
        lo, hi = bounds[task], bounds[task + 1]
        tr.train_task(task, lo, hi)
        tr.rebuild_memory(hi, range(lo, hi))
        for j, (c, n) in enumerate(tr.evaluate(bounds, task)):
            cnn_acc[task, j], nme_acc[task, j] = c, n
        if tr.rank == 0:
            print(f"== task {task}: CNN {cnn_acc[task, :task + 1].mean():.2f} "
                  f"NME {nme_acc[task, :task + 1].mean():.2f}", flush=True)
            os.makedirs(cfg["out"], exist_ok=True)
            torch.save({"backbone": tr.backbone.state_dict(), "head": tr.head.state_dict(),
                        "memory": tr.memory, "cnn": cnn_acc, "nme": nme_acc},
                       os.path.join(cfg["out"], f"task{task}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
