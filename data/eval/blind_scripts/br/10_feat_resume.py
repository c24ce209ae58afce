"""FEAT (Few-shot Embedding Adaptation with Transformer, Ye et al. CVPR'20), multi-GPU.

Starts from a pre-trained ResNet-12 (--init-weights) and meta-trains the
set-to-set transformer together with the backbone. Long runs are preempted,
so the script writes a full checkpoint every epoch and can --resume from it.

    torchrun --nproc_per_node=4 10_feat_resume.py --init-weights saves/res12-pre.pth
    torchrun --nproc_per_node=4 10_feat_resume.py --resume checkpoints/feat/last.pth
"""
import argparse
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from model.networks.res12 import ResNet
from model.dataloader.mini_imagenet import MiniImageNet
from model.dataloader.samplers import CategoriesSampler


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, dropout=0.5):
        super().__init__()
        self.n_head, self.d_k = n_head, d_k
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.fc = nn.Linear(n_head * d_k, d_model)
        self.layer_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v):
        b, n, _ = q.shape
        residual = q
        q = self.w_qs(q).view(b, n, self.n_head, self.d_k).transpose(1, 2)
        k = self.w_ks(k).view(b, n, self.n_head, self.d_k).transpose(1, 2)
        v = self.w_vs(v).view(b, n, self.n_head, self.d_k).transpose(1, 2)
        attn = torch.softmax(q @ k.transpose(-1, -2) / self.d_k ** 0.5, dim=-1)
        out = (self.dropout(attn) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.layer_norm(self.dropout(self.fc(out)) + residual)


class FEAT(nn.Module):
    def __init__(self, temperature=64.0, temperature2=64.0):
        super().__init__()
        self.encoder = ResNet()
        self.slf_attn = MultiHeadAttention(1, 640, 640, dropout=0.5)
        self.temperature, self.temperature2 = temperature, temperature2

    def forward(self, x, way, shot, query, num_base_classes=None):
        emb = self.encoder(x)
        n_s = way * shot
        support = emb[:n_s].view(shot, way, -1)
        q = emb[n_s:]
        proto = self.slf_attn(*(support.mean(0, keepdim=True),) * 3).squeeze(0)
        logits = -((q.unsqueeze(1) - proto.unsqueeze(0)) ** 2).sum(-1) / self.temperature
        if not self.training:
            return logits, None
        # contrastive regulariser: adapt each class' support+query set and classify
        # every instance against the adapted class centres
        aux = torch.cat([support, q.view(query, way, -1)], 0).transpose(0, 1)  # [way, shot+query, d]
        aux = self.slf_attn(aux, aux, aux)
        centers = aux.mean(1)
        aux_logits = -((aux.reshape(-1, aux.size(-1)).unsqueeze(1) - centers.unsqueeze(0)) ** 2).sum(-1)
        return logits, aux_logits / self.temperature2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-root", default="/data/miniimagenet")
    p.add_argument("--init-weights", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--save-dir", default="checkpoints/feat")
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=1)
    p.add_argument("--query", type=int, default=15)
    p.add_argument("--max-epoch", type=int, default=200)
    p.add_argument("--episodes-per-epoch", type=int, default=100)
    p.add_argument("--num-eval-episodes", type=int, default=600)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-mul", type=float, default=10.0)
    p.add_argument("--balance", type=float, default=0.01)
    p.add_argument("--step-size", type=int, default=40)
    p.add_argument("--gamma", type=float, default=0.5)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    label = torch.arange(args.way, device=device).repeat(args.query)
    accs = []
    for x, _ in loader:
        logits, _ = model(x.to(device, non_blocking=True), args.way, args.shot, args.query)
        accs.append((logits.argmax(1) == label).float().mean())
    model.train()
    accs = torch.stack(accs)
    out = [torch.zeros_like(accs) for _ in range(dist.get_world_size())]
    dist.all_gather(out, accs)
    accs = torch.cat(out).cpu().numpy()
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # CategoriesSampler draws from the global torch RNG: seed per rank so the ranks
    # see different episodes (DDP broadcasts rank 0's initial weights anyway)
    torch.manual_seed(1 + rank)

    trainset = MiniImageNet("train", args.dataset_root, augment=True)
    valset = MiniImageNet("val", args.dataset_root)
    per = args.shot + args.query
    train_loader = DataLoader(trainset, num_workers=8, pin_memory=True,
                              batch_sampler=CategoriesSampler(trainset.label, args.episodes_per_epoch,
                                                              args.way, per))
    val_loader = DataLoader(valset, num_workers=8, pin_memory=True,
                            batch_sampler=CategoriesSampler(valset.label,
                                                            args.num_eval_episodes // world,
                                                            args.way, per))

    model = FEAT().to(device)
    if args.init_weights and not args.resume:
        pretrained = torch.load(args.init_weights, map_location="cpu")["params"]
        pretrained = {k.replace("encoder.", "", 1): v for k, v in pretrained.items()
                      if k.startswith("encoder.")}
        missing, _ = model.encoder.load_state_dict(pretrained, strict=False)
        if rank == 0:
            print(f"loaded {args.init_weights}; missing keys: {missing}")
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam([
        {"params": model.module.encoder.parameters()},
        {"params": model.module.slf_attn.parameters(), "lr": args.lr * args.lr_mul},
    ], lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)

    start_epoch, best_acc = 1, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    label = torch.arange(args.way, device=device).repeat(args.query)
    label_aux = torch.arange(args.way, device=device).repeat_interleave(per)
    for epoch in range(start_epoch, args.max_epoch + 1):
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for x, _ in train_loader:
            logits, aux_logits = model(x.to(device, non_blocking=True), args.way, args.shot, args.query)
            loss = F.cross_entropy(logits, label)
            total_loss = loss + args.balance * F.cross_entropy(aux_logits, label_aux)
            optimizer.zero_grad()
            total_loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), (logits.argmax(1) == label).float().mean(),
                                  torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)
        vacc, vci = evaluate(model, val_loader, args, device)

        if rank == 0:
            print(f"epoch {epoch}: loss {meter[0] / meter[2]:.4f} acc {meter[1] / meter[2]:.4f} "
                  f"| val {100 * vacc:.2f}+-{100 * vci:.2f} | {time.time() - tic:.0f}s", flush=True)
            if vacc > best_acc:
                best_acc = vacc
                torch.save({"params": model.module.state_dict()}, osp.join(args.save_dir, "max_acc.pth"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc},
                       osp.join(args.save_dir, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
