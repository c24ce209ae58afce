"""Few-shot defect-type classification with Prototypical Networks.

Episodes are sampled from the base defect classes (meta-train split of our
defect library); the held-out novel classes are used for meta-validation.
Each GPU runs its own slice of every epoch's episode list.

    torchrun --nproc_per_node=4 03_fewshot_protonet.py --data /nfs/defect_library \
        --way 5 --shot 5 --query 10 --episodes 2000 --out /nfs/runs/protonet_r18
"""
import argparse
import json
import math
import os
import random
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=5)
    p.add_argument("--query", type=int, default=10)
    p.add_argument("--episodes", type=int, default=2000, help="episodes per epoch, all GPUs together")
    p.add_argument("--val-episodes", type=int, default=400)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3, help="single-GPU learning rate")
    p.add_argument("--img-size", type=int, default=160)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--resume", default="")
    return p.parse_args()


class DefectLibrary(Dataset):
    """<root>/<split>/<defect_type>/*.jpg"""

    def __init__(self, root, split, img_size, train):
        self.items, self.by_class = [], defaultdict(list)
        class_dirs = sorted(d for d in (Path(root) / split).iterdir() if d.is_dir())
        self.classes = [d.name for d in class_dirs]
        for ci, d in enumerate(class_dirs):
            for f in sorted(d.glob("*.jpg")):
                self.by_class[ci].append(len(self.items))
                self.items.append((str(f), ci))
        aug = [transforms.RandomResizedCrop(img_size, scale=(0.6, 1.0)), transforms.RandomHorizontalFlip(),
               transforms.ColorJitter(0.2, 0.2)] if train else [transforms.Resize(int(img_size * 1.15)),
                                                                   transforms.CenterCrop(img_size)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(),
                                            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, c = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), c


class ShardedEpisodeSampler(Sampler):
    """Yields one episode (list of dataset indices) per batch.

    The full episode list is drawn from an RNG seeded with (seed, epoch), so it
    is identical on every rank; rank r then takes episodes r, r+W, r+2W, ...
    """

    def __init__(self, by_class, way, shot, query, episodes, rank, world_size, seed):
        assert episodes % world_size == 0, "episodes must be divisible by the number of GPUs"
        self.by_class = {c: idx for c, idx in by_class.items() if len(idx) >= shot + query}
        self.way, self.shot, self.query = way, shot, query
        self.episodes, self.rank, self.world_size, self.seed = episodes, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.episodes // self.world_size

    def __iter__(self):
        rng = random.Random(self.seed * 10007 + self.epoch)
        classes = sorted(self.by_class)
        all_eps = []
        for _ in range(self.episodes):
            chosen = rng.sample(classes, self.way)
            support, query = [], []
            for c in chosen:
                picks = rng.sample(self.by_class[c], self.shot + self.query)
                support += picks[:self.shot]
                query += picks[self.shot:]
            all_eps.append(support + query)
        return iter(all_eps[self.rank::self.world_size])


class ProtoNet(nn.Module):
    def __init__(self):
        super().__init__()
        r18 = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1)
        self.encoder = nn.Sequential(*list(r18.children())[:-1], nn.Flatten())

    def forward(self, x):
        return self.encoder(x)


def episode_logits(emb, way, shot, query):
    support = emb[: way * shot].view(way, shot, -1)
    q = emb[way * shot:]
    protos = support.mean(dim=1)
    return -torch.cdist(q, protos) ** 2


def episode_targets(way, query, device):
    return torch.arange(way, device=device).repeat_interleave(query)


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def run_epoch(model, loader, args, device, opt=None):
    train = opt is not None
    model.train(train)
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    with torch.set_grad_enabled(train):
        for images, _ in loader:
            images = images.to(device, non_blocking=True)
            emb = model(images)
            logits = episode_logits(emb, args.way, args.shot, args.query)
            target = episode_targets(args.way, args.query, device)
            loss = F.cross_entropy(logits, target)
            if train:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            stats += torch.stack([loss.detach() * target.numel(),
                                  (logits.argmax(1) == target).sum().float(),
                                  torch.tensor(float(target.numel()), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_set = DefectLibrary(args.data, "base", args.img_size, train=True)
    val_set = DefectLibrary(args.data, "novel", args.img_size, train=False)
    train_sampler = ShardedEpisodeSampler(train_set.by_class, args.way, args.shot, args.query,
                                          args.episodes, rank, world_size, args.seed)
    val_sampler = ShardedEpisodeSampler(val_set.by_class, args.way, args.shot, args.query,
                                        args.val_episodes, rank, world_size, args.seed + 1)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = ProtoNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    # W episodes per optimizer step now; Adam behaves better with sqrt scaling than linear
    lr = args.lr * math.sqrt(world_size)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, args.epochs // 4), gamma=0.5)

    out = Path(args.out)
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(out / "tb"))
        with open(out / "args.json", "w") as f:
            json.dump(vars(args) | {"world_size": world_size, "effective_lr": lr}, f, indent=2)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        tr_loss, tr_acc = run_epoch(model, train_loader, args, device, opt)
        sched.step()
        val_loss, val_acc = run_epoch(model, val_loader, args, device)

        if rank == 0:
            writer.add_scalar("train/loss", tr_loss, epoch)
            writer.add_scalar("train/acc", tr_acc, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            print(f"[{epoch:03d}] train {tr_loss:.3f}/{tr_acc:.3f}  val {val_loss:.3f}/{val_acc:.3f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch, "best_acc": max(best_acc, val_acc)}
            torch.save(ckpt, out / "last.pt")
            if val_acc > best_acc:
                torch.save(ckpt, out / "best.pt")
        best_acc = max(best_acc, val_acc)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
