"""
Multi-task fine-grained classification: one shared ViT-S/16 trunk, one linear head per dataset
(Stanford Cars, Oxford Flowers, FGVC Aircraft, CUB). Each optimizer step draws one task; every
rank draws the same task (shared generator) but its own shard of that task's images.

    torchrun --nproc_per_node=4 20_multitask_vit_finegrained.py --root /data/finegrained --steps 30000
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

TASKS = ["cars", "flowers", "aircraft", "cub"]


def index_images(root, task, split):
    """Walk <root>/<task>/<split>/<class>/*.jpg once and return (paths, labels, classes)."""
    base = os.path.join(root, task, split)
    classes = sorted(os.listdir(base))
    items = [(os.path.join(base, c, f), i) for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(base, c)))]
    return {"items": items, "classes": classes}


class ListDataset(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), label


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class MultiTaskViT(nn.Module):
    def __init__(self, num_classes, dim=384, depth=12, heads=6, img=224, patch=16, grad_ckpt=True):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleDict({t: nn.Linear(dim, n) for t, n in num_classes.items()})
        self.grad_ckpt = grad_ckpt

    def forward(self, x, task):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = cp.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.heads[task](self.norm(x[:, 0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--pretrained", default="", help="ViT-S trunk state_dict")
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4, help="for a total batch of 256")
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--out", default="runs/mt_vit")
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    # build the file index once on rank 0; the others wait and read it
    index_file = os.path.join(args.out, "index.json")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(index_file):
            idx = {t: {s: index_images(args.root, t, s) for s in ("train", "test")} for t in TASKS}
            with open(index_file + ".tmp", "w") as f:
                json.dump(idx, f)
            os.replace(index_file + ".tmp", index_file)
    dist.barrier()
    with open(index_file) as f:
        index = json.load(f)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.35, 1)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])

    samplers, loaders, test_loaders = {}, {}, {}
    for t in TASKS:
        tr = ListDataset([tuple(x) for x in index[t]["train"]["items"]], train_tf)
        te = ListDataset([tuple(x) for x in index[t]["test"]["items"]], test_tf)
        samplers[t] = DistributedSampler(tr, shuffle=True, drop_last=True)
        loaders[t] = DataLoader(tr, batch_size=args.batch_size, sampler=samplers[t], num_workers=4,
                                pin_memory=True, drop_last=True)
        test_loaders[t] = DataLoader(Subset(te, range(rank, len(te), world)), batch_size=128, num_workers=4)

    num_classes = {t: len(index[t]["train"]["classes"]) for t in TASKS}
    model = MultiTaskViT(num_classes)
    if args.pretrained:
        missing, unexpected = model.load_state_dict(torch.load(args.pretrained, map_location="cpu"), strict=False)
        if rank == 0:
            print(f"loaded trunk: {len(missing)} missing (heads), {len(unexpected)} unexpected")
    model.cuda()
    # only the head of the sampled task is used in a step, the other heads get no gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))

    if rank == 0 and args.wandb:
        import wandb
        wandb.init(project="multitask-vit", config=vars(args))

    task_rng = random.Random(1234)  # identical sequence of tasks on every rank
    epochs = {t: 0 for t in TASKS}
    iters = {}
    for t in TASKS:
        samplers[t].set_epoch(0)
        iters[t] = iter(loaders[t])

    def next_batch(t):
        try:
            return next(iters[t])
        except StopIteration:
            epochs[t] += 1
            samplers[t].set_epoch(epochs[t])
            iters[t] = iter(loaders[t])
            return next(iters[t])

    weights = [len(index[t]["train"]["items"]) ** 0.5 for t in TASKS]
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        task = task_rng.choices(TASKS, weights=weights)[0]
        x, y = next_batch(task)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, task)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sched.step()

        if step % 100 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} task {task} loss {l.item():.4f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                if args.wandb:
                    wandb.log({f"train/loss_{task}": l.item(), "lr": sched.get_last_lr()[0]}, step=step)
            t0 = time.time()

        if step % args.eval_every == 0 or step == args.steps:
            net = model.module
            net.eval()
            acc = torch.zeros(len(TASKS), 2, device="cuda")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for i, t in enumerate(TASKS):
                    for x, y in test_loaders[t]:
                        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                        acc[i, 0] += (net(x, t).argmax(1) == y).sum()
                        acc[i, 1] += y.numel()
            dist.all_reduce(acc)
            net.train()
            if rank == 0:
                res = {t: (acc[i, 0] / acc[i, 1]).item() for i, t in enumerate(TASKS)}
                print(f"step {step} " + " ".join(f"{t}={v * 100:.2f}" for t, v in res.items()), flush=True)
                if args.wandb:
                    wandb.log({f"test/{t}": v for t, v in res.items()}, step=step)
                torch.save({"model": net.state_dict(), "step": step, "num_classes": num_classes},
                           os.path.join(args.out, "model.pt"))
            dist.barrier()

    if rank == 0 and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
