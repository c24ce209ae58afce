"""Proxy-Anchor loss on Cars196 (first 98 classes train, last 98 test), BN-Inception-like
trunk from timm. The proxies live inside the DDP module so their gradients are averaged
like every other weight.

    torchrun --nproc_per_node=4 16_proxy_anchor_cars196.py --data /data/cars196
"""
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import timm
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cars196")
    p.add_argument("--backbone", default="inception_v3.tv_in1k")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=45, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--proxy-lr-mult", type=float, default=100.0)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--mrg", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--save-dir", default="/nfs/exp/proxy_anchor_cars")
    return p.parse_args()


class Cars196(Dataset):
    def __init__(self, root, train, transform):
        annos = scipy.io.loadmat(os.path.join(root, "cars_annos.mat"))["annotations"][0]
        self.items = []
        for a in annos:
            path, label = str(a[0][0]), int(a[5][0][0]) - 1
            if (label < 98) == train:
                self.items.append((os.path.join(root, path), label if train else label - 98))
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), y, i


class ProxyAnchorNet(nn.Module):
    def __init__(self, backbone, dim, n_classes, alpha, mrg):
        super().__init__()
        self.trunk = timm.create_model(backbone, pretrained=True, num_classes=0)
        self.embedding = nn.Linear(self.trunk.num_features, dim)
        nn.init.kaiming_normal_(self.embedding.weight, mode="fan_out")
        self.proxies = nn.Parameter(torch.randn(n_classes, dim))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")
        self.alpha, self.mrg, self.n_classes = alpha, mrg, n_classes

    def embed(self, x):
        return F.normalize(self.embedding(self.trunk(x)), dim=1)

    def forward(self, x, y):
        z = self.embed(x)
        cos = F.linear(z, F.normalize(self.proxies, dim=1))
        p_one_hot = F.one_hot(y, self.n_classes).float()
        n_one_hot = 1 - p_one_hot
        pos_exp = torch.exp(-self.alpha * (cos - self.mrg))
        neg_exp = torch.exp(self.alpha * (cos + self.mrg))
        with_pos = (p_one_hot.sum(0) != 0).nonzero().squeeze(1)
        p_sim_sum = torch.where(p_one_hot == 1, pos_exp, torch.zeros_like(pos_exp)).sum(0)
        n_sim_sum = torch.where(n_one_hot == 1, neg_exp, torch.zeros_like(neg_exp)).sum(0)
        pos_term = torch.log(1 + p_sim_sum).sum() / max(len(with_pos), 1)
        neg_term = torch.log(1 + n_sim_sum).sum() / self.n_classes
        return pos_term + neg_term


@torch.no_grad()
def evaluate(model, loader, n_total, device, ks=(1, 2, 4, 8)):
    model.eval()
    feats, labels, idxs = [], [], []
    for x, y, i in loader:
        feats.append(model.module.embed(x.to(device, non_blocking=True)))
        labels.append(y.to(device))
        idxs.append(i.to(device))
    feats, labels, idxs = torch.cat(feats), torch.cat(labels), torch.cat(idxs)
    world = dist.get_world_size()
    g_feats = feats.new_empty(world * feats.size(0), feats.size(1))
    g_labels = labels.new_empty(world * labels.size(0))
    g_idxs = idxs.new_empty(world * idxs.size(0))
    dist.all_gather_into_tensor(g_feats, feats)
    dist.all_gather_into_tensor(g_labels, labels)
    dist.all_gather_into_tensor(g_idxs, idxs)
    # drop the samples DistributedSampler repeated to pad the last rank
    uniq = torch.zeros(n_total, dtype=torch.long, device=device)
    uniq[g_idxs] = torch.arange(g_idxs.numel(), device=device)
    feats, labels = g_feats[uniq], g_labels[uniq]
    sim = feats @ feats.t()
    sim.fill_diagonal_(-2.0)
    topk = sim.topk(max(ks), dim=1).indices
    hits = labels[topk] == labels[:, None]
    model.train()
    return {k: hits[:, :k].any(1).float().mean().item() for k in ks}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train_set = Cars196(args.data, True, transforms.Compose([
        transforms.RandomResizedCrop(299), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(mean, std)]))
    test_set = Cars196(args.data, False, transforms.Compose([
        transforms.Resize(342), transforms.CenterCrop(299), transforms.ToTensor(), transforms.Normalize(mean, std)]))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=128, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=8, pin_memory=True)

    net = ProxyAnchorNet(args.backbone, args.dim, 98, args.alpha, args.mrg).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": net.trunk.parameters(), "lr": args.lr},
        {"params": net.embedding.parameters(), "lr": args.lr},
        {"params": [net.proxies], "lr": args.lr * args.proxy_lr_mult},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    os.makedirs(args.save_dir, exist_ok=True)
    best_r1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 10)
            optimizer.step()
            if rank == 0 and it % 20 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.4f} {time.time() - tic:.0f}s",
                      flush=True)
        scheduler.step()

        recalls = evaluate(model, test_loader, len(test_set), device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"R@{k} {v * 100:.2f}" for k, v in recalls.items()), flush=True)
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch, "recall": recalls}
        torch.save(state, os.path.join(args.save_dir, "last.pth"))
        if recalls[1] > best_r1:
            best_r1 = recalls[1]
            torch.save(state, os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
