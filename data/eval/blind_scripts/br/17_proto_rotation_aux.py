# ProtoNet + rotation self-supervision (Gidaris et al., ICCV'19 style), CIFAR-FS / FC100.
#
# The rotation loss is an auxiliary term; computing it on every episode
# doubles the backbone cost, so by default it is added every --rot-every
# episodes only.
#
#   torchrun --nproc_per_node=2 17_proto_rotation_aux.py --dataset fc100 --data /data/fc100
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
import torchvision.transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=["cifarfs", "fc100"], default="fc100")
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/proto_rot")
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=5)
    p.add_argument("--query", type=int, default=6)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--episodes", type=int, default=800)
    p.add_argument("--val-episodes", type=int, default=1000)
    p.add_argument("--rot-weight", type=float, default=0.5)
    p.add_argument("--rot-every", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class FSPickle(Dataset):
    def __init__(self, root, dataset, split, train):
        prefix = "CIFAR_FS" if dataset == "cifarfs" else "FC100"
        with open(os.path.join(root, f"{prefix}_{split}.pickle"), "rb") as f:
            d = pickle.load(f, encoding="latin1")
        self.x = d["data"]
        _, self.y = np.unique(np.asarray(d["labels"]), return_inverse=True)
        norm = T.Normalize([0.507, 0.487, 0.441], [0.267, 0.256, 0.276])
        self.tf = T.Compose(([T.ToPILImage(), T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
                             if train else [T.ToPILImage()]) + [T.ToTensor(), norm])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.tf(self.x[i]), int(self.y[i])


class Episodes:
    def __init__(self, y, n, way, per, seed):
        self.idx = [np.flatnonzero(y == c) for c in range(y.max() + 1)]
        self.n, self.way, self.per = n, way, per
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            cls = self.rng.choice(len(self.idx), self.way, replace=False)
            yield np.stack([self.rng.choice(self.idx[c], self.per, replace=False) for c in cls],
                           1).ravel().tolist()


def resblock(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.LeakyReLU(0.1), nn.MaxPool2d(2))


class ProtoRot(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(resblock(3, 64), resblock(64, 160), resblock(160, 320),
                                      resblock(320, 640), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.rot_head = nn.Sequential(nn.Linear(640, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, x, with_rotation=False):
        if not with_rotation:
            return self.backbone(x), None
        n = x.size(0)
        rotated = torch.cat([torch.rot90(x, k, dims=(2, 3)) for k in range(4)])
        feats = self.backbone(rotated)
        return feats[:n], self.rot_head(feats)


def proto_logits(feats, way, shot):
    protos = feats[:way * shot].view(shot, way, -1).mean(0)
    return -torch.cdist(feats[way * shot:], protos).pow(2) / 64.0


@torch.no_grad()
def evaluate(model, loader, way, shot, query, device):
    model.eval()
    y = torch.arange(way, device=device).repeat(query)
    acc = []
    for x, _ in loader:
        feats, _ = model(x.to(device))
        acc.append((proto_logits(feats, way, shot).argmax(1) == y).float().mean())
    model.train()
    acc = torch.stack(acc)
    agg = torch.stack([acc.sum(), (acc ** 2).sum(), torch.tensor(float(acc.numel()), device=device)])
    dist.all_reduce(agg)
    mu = agg[0] / agg[2]
    return mu.item(), (1.96 * ((agg[1] / agg[2] - mu ** 2).clamp_min(0) / agg[2]).sqrt()).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train = FSPickle(args.data, args.dataset, "train", train=True)
    val = FSPickle(args.data, args.dataset, "val", train=False)
    per = args.shot + args.query
    train_loader = DataLoader(train, batch_sampler=Episodes(train.y, args.episodes, args.way, per,
                                                           seed=args.seed * 31 + rank),
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val, batch_sampler=Episodes(val.y, args.val_episodes // world, args.way, per,
                                                        seed=555 + rank),
                            num_workers=args.workers, pin_memory=True)

    model = DDP(ProtoRot().to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [40, 60, 70], gamma=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    y_q = torch.arange(args.way, device=device).repeat(args.query)
    best, step = 0.0, 0
    for epoch in range(1, args.epochs + 1):
        tic = time.time()
        sums = torch.zeros(3, device=device)
        for x, _ in train_loader:
            x = x.to(device, non_blocking=True)
            use_rot = args.rot_weight > 0 and step % args.rot_every == 0
            feats, rot_logits = model(x, with_rotation=use_rot)
            loss = F.cross_entropy(proto_logits(feats, args.way, args.shot), y_q)
            if use_rot:
                rot_y = torch.arange(4, device=device).repeat_interleave(x.size(0))
                loss = loss + args.rot_weight * F.cross_entropy(rot_logits, rot_y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sums += torch.stack([loss.detach(), torch.tensor(float(use_rot), device=device),
                                 torch.ones((), device=device)])
            step += 1
        scheduler.step()
        dist.all_reduce(sums)
        acc, ci = evaluate(model, val_loader, args.way, args.shot, args.query, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {sums[0] / sums[2]:.4f} (rot on {sums[1] / sums[2]:.0%} of episodes) "
                  f"val {100 * acc:.2f} +- {100 * ci:.2f}  [{time.time() - tic:.0f}s]", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "val_acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
