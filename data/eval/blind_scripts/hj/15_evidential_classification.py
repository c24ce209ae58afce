"""Evidential deep learning (Sensoy et al., 2018) for CIFAR-100 with DDP.

The network outputs non-negative evidence e_k; alpha = e + 1 parameterises a
Dirichlet over class probabilities. Loss: expected MSE under the Dirichlet
(Eq. 5) + annealed KL to the uniform Dirichlet on the misleading evidence.
Uncertainty mass u = K / sum(alpha) is used for OOD detection on SVHN.

    torchrun --nproc_per_node=8 15_evidential_classification.py --epochs 200 --amp
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data")
    p.add_argument("--out", default="runs/edl_c100")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--anneal-epochs", type=int, default=10)
    p.add_argument("--evidence", default="softplus", choices=["relu", "softplus", "exp"])
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def to_evidence(logits, kind):
    if kind == "relu":
        return F.relu(logits)
    if kind == "exp":
        return torch.exp(logits.clamp(-10, 10))
    return F.softplus(logits)


def kl_to_uniform(alpha):
    K = alpha.size(1)
    S = alpha.sum(1, keepdim=True)
    ones = torch.ones_like(alpha)
    t1 = torch.lgamma(S).squeeze(1) - torch.lgamma(alpha).sum(1) - torch.lgamma(ones.sum(1))
    t2 = ((alpha - ones) * (torch.digamma(alpha) - torch.digamma(S))).sum(1)
    return t1 + t2


def edl_mse_loss(evidence, y, epoch, anneal_epochs):
    K = evidence.size(1)
    onehot = F.one_hot(y, K).float()
    alpha = evidence + 1.0
    S = alpha.sum(1, keepdim=True)
    p = alpha / S
    err = ((onehot - p) ** 2).sum(1)
    var = (p * (1 - p) / (S + 1)).sum(1)
    coef = min(1.0, epoch / anneal_epochs)
    alpha_tilde = onehot + (1 - onehot) * alpha
    return (err + var + coef * kl_to_uniform(alpha_tilde)).mean()


def cifar_resnet18(num_classes):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def predict(model, loader, device, kind):
    model.eval()
    us, hits = [], []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        alpha = to_evidence(model(x).float(), kind) + 1.0
        S = alpha.sum(1)
        us.append(alpha.size(1) / S)
        hits.append((alpha.argmax(1) == y).float())
    return torch.cat(us), torch.cat(hits)


def all_gather_var(t):
    """all_gather for 1-D tensors whose length differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    padded = torch.zeros(m, device=t.device, dtype=t.dtype)
    padded[: t.numel()] = t
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[: int(s.item())] for b, s in zip(bufs, sizes)])


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    train = torchvision.datasets.CIFAR100(os.path.join(args.data, "cifar100"), True,
                                          T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                                                     T.ToTensor(), norm]))
    test = torchvision.datasets.CIFAR100(os.path.join(args.data, "cifar100"), False, T.Compose([T.ToTensor(), norm]))
    svhn = torchvision.datasets.SVHN(os.path.join(args.data, "svhn"), "test", transform=T.Compose([T.ToTensor(), norm]))
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    shard = lambda ds: DataLoader(Subset(ds, range(rank, len(ds), world)), 500, num_workers=4)
    test_loader, ood_loader = shard(test), shard(svhn)

    model = cifar_resnet18(100)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 128,
                          momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"],
                                                total_steps=args.epochs * len(loader), pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)  # loss sum, batches, skipped
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(x)
            loss = edl_mse_loss(to_evidence(logits.float(), args.evidence), y, epoch, args.anneal_epochs)
            if not torch.isfinite(loss):
                # lgamma/digamma occasionally blow up early on with exp evidence
                stats[2] += 1
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            stats[0] += loss.detach()
            stats[1] += 1
        dist.all_reduce(stats)

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            u_in, hit = predict(model.module, test_loader, device, args.evidence)
            u_out, _ = predict(model.module, ood_loader, device, args.evidence)
            u_in, hit, u_out = all_gather_var(u_in), all_gather_var(hit), all_gather_var(u_out)
            if rank == 0:
                scores = torch.cat([u_in, u_out]).cpu().numpy()
                labels = np.r_[np.zeros(len(u_in)), np.ones(len(u_out))]
                print(f"epoch {epoch} loss {(stats[0] / stats[1].clamp_min(1)).item():.4f} "
                      f"skipped {int(stats[2].item())} acc {hit.mean().item():.4f} "
                      f"AUROC(svhn) {roc_auc_score(labels, scores):.4f} ({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "edl_last.pt"))
        elif rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1].clamp_min(1)).item():.4f} "
                  f"skipped {int(stats[2].item())}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
