"""
ViT-S/16 on ImageNet-100 with a distributed Shampoo.

Gradients are averaged by DDP as usual. The expensive part of Shampoo, the
inverse 4th roots of the Kronecker factors, is spread over the ranks: every
`precond_every` steps rank (i % world_size) recomputes the roots of matrix i
and broadcasts them. Norm grafting from SGD keeps the step size sane.

usage:
    torchrun --standalone --nproc_per_node=8 04_dist_shampoo_vit.py --data /data/imagenet100
"""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class DistributedShampoo(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, momentum=0.9, weight_decay=0.05, eps=1e-6,
                 precond_every=20, start_precond=100, beta2=0.999):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps, beta2=beta2)
        super().__init__(params, defaults)
        self.precond_every = precond_every
        self.start_precond = start_precond
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.step_count = 0

    @staticmethod
    def _inv_root(mat, eps, root=4):
        mat = mat.float()
        mat = mat + eps * torch.eye(mat.size(0), device=mat.device, dtype=mat.dtype)
        evals, evecs = torch.linalg.eigh(mat)
        evals = evals.clamp_min(eps).pow(-1.0 / root)
        return (evecs * evals.unsqueeze(0)) @ evecs.T

    @torch.no_grad()
    def _refresh_roots(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                owner = i % self.world_size
                if self.rank == owner:
                    state["PL"].copy_(self._inv_root(state["L"], group["eps"]))
                    state["PR"].copy_(self._inv_root(state["R"], group["eps"]))
                dist.broadcast(state["PL"], src=owner)
                dist.broadcast(state["PR"], src=owner)
                i += 1

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                state = self.state[p]
                if not state:
                    m, n = p.shape
                    state["L"] = torch.zeros(m, m, device=p.device)
                    state["R"] = torch.zeros(n, n, device=p.device)
                    state["PL"] = torch.eye(m, device=p.device)
                    state["PR"] = torch.eye(n, device=p.device)
                    state["mom"] = torch.zeros_like(p)
                gf = g.float()
                b2 = group["beta2"]
                state["L"].mul_(b2).add_(gf @ gf.T, alpha=1 - b2)
                state["R"].mul_(b2).add_(gf.T @ gf, alpha=1 - b2)
        if self.step_count >= self.start_precond and self.step_count % self.precond_every == 0:
            self._refresh_roots()

        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad.float()
                state = self.state[p]
                pg = state["PL"] @ g @ state["PR"]
                # graft the norm of the plain gradient onto the Shampoo direction
                pg.mul_(g.norm() / (pg.norm() + 1e-12))
                state["mom"].mul_(group["momentum"]).add_(pg.to(p.dtype))
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(state["mom"], alpha=-group["lr"])


def build_loaders(args, world_size, rank):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandAugment(2, 9),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                 transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers,
                        pin_memory=True)
    return train_dl, val_dl, train_sampler, len(train_ds.classes)


def to_gpu(*tensors):
    return [t.cuda(non_blocking=True) for t in tensors]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/imagenet100")
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--adam_lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--max_precond_dim", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/shampoo_vits")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")

    train_dl, val_dl, train_sampler, num_classes = build_loaders(args, world_size, rank)
    model = timm.create_model(args.model, num_classes=num_classes, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])

    shampoo_params, other_params = [], []
    for name, p in model.module.named_parameters():
        if p.ndim == 2 and max(p.shape) <= args.max_precond_dim:
            shampoo_params.append(p)
        else:
            other_params.append(p)
    shampoo = DistributedShampoo(shampoo_params, lr=args.lr, weight_decay=args.wd)
    adamw = torch.optim.AdamW(other_params, lr=args.adam_lr, weight_decay=0.0)
    optimizers = [shampoo, adamw]
    base_lrs = [[g["lr"] for g in o.param_groups] for o in optimizers]

    total_steps = args.epochs * len(train_dl)
    warmup = 5 * len(train_dl)

    def set_lr(step):
        if step < warmup:
            f = (step + 1) / warmup
        else:
            f = 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup)))
        for o, lrs in zip(optimizers, base_lrs):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * f

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"{len(shampoo_params)} shampoo matrices, {len(other_params)} adamw tensors")

    step = 0
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, labels in train_dl:
            images, labels = to_gpu(images, labels)
            set_lr(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for images, labels in val_dl:
                images, labels = to_gpu(images, labels)
                pred = model(images).argmax(-1)
                correct[0] += (pred == labels).sum()
                correct[1] += labels.numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val_acc {acc:.4f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
