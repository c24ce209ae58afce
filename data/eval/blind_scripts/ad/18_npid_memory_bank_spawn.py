"""Instance discrimination (NPID) with a non-parametric memory bank, one process per GPU.

    python 18_npid_memory_bank_spawn.py /datasets/imagenet --dist-url tcp://127.0.0.1:23456 \
        --nodes 1 --node-rank 0 --batch-size 256 --epochs 200
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_parser():
    parser = argparse.ArgumentParser("NPID")
    parser.add_argument("data")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--low-dim", type=int, default=128)
    parser.add_argument("--nce-k", type=int, default=4096, help="negatives drawn from the bank")
    parser.add_argument("--nce-t", type=float, default=0.07)
    parser.add_argument("--nce-m", type=float, default=0.5, help="memory bank momentum")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.03, help="for the global batch size")
    parser.add_argument("--workers", type=int, default=32, help="per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    parser.add_argument("--out", default="npid_ckpt")
    parser.add_argument("--knn-k", type=int, default=200)
    return parser


class IndexedImageFolder(datasets.ImageFolder):
    def __getitem__(self, index):
        img, target = super().__getitem__(index)
        return img, target, index


class MemoryBank(nn.Module):
    """N x D unit vectors, one per training image; identical copy on every rank."""

    def __init__(self, n, dim, momentum):
        super().__init__()
        self.momentum = momentum
        stdv = 1.0 / math.sqrt(dim / 3)
        self.register_buffer("bank", F.normalize(torch.rand(n, dim).mul_(2 * stdv).add_(-stdv), dim=1))

    @torch.no_grad()
    def update(self, feats, idx):
        all_feats = [torch.empty_like(feats) for _ in range(dist.get_world_size())]
        all_idx = [torch.empty_like(idx) for _ in range(dist.get_world_size())]
        dist.all_gather(all_feats, feats.detach())
        dist.all_gather(all_idx, idx)
        feats, idx = torch.cat(all_feats), torch.cat(all_idx)
        mixed = self.bank[idx] * self.momentum + feats * (1 - self.momentum)
        self.bank.index_copy_(0, idx, F.normalize(mixed, dim=1))


def nce_softmax_loss(feats, idx, bank, k, t):
    """Softmax over the positive bank entry and k random bank entries."""
    n = bank.bank.size(0)
    neg_idx = torch.randint(0, n, (feats.size(0), k), device=feats.device)
    pos = (feats * bank.bank[idx]).sum(1, keepdim=True)
    neg = torch.bmm(bank.bank[neg_idx], feats.unsqueeze(2)).squeeze(2)
    logits = torch.cat([pos, neg], dim=1) / t
    return F.cross_entropy(logits, torch.zeros(feats.size(0), dtype=torch.long, device=feats.device))


@torch.no_grad()
def knn_top1(net, bank, train_labels, val_loader, k, t, device, num_classes=1000):
    net.eval()
    correct = torch.zeros(2, device=device)
    for img, target, _ in val_loader:
        img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
        f = F.normalize(net(img), dim=1)
        sim = f @ bank.bank.t()
        top_sim, top_idx = sim.topk(k, dim=1)
        votes = torch.zeros(f.size(0), num_classes, device=device)
        votes.scatter_add_(1, train_labels[top_idx], (top_sim / t).exp())
        correct += torch.stack([(votes.argmax(1) == target).float().sum(),
                                torch.tensor(float(f.size(0)), device=device)])
    dist.all_reduce(correct)
    net.train()
    return (correct[0] / correct[1]).item()


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0)), transforms.RandomGrayscale(p=0.2),
        transforms.ColorJitter(0.4, 0.4, 0.4, 0.4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = IndexedImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = IndexedImageFolder(os.path.join(args.data, "val"), val_tf)
    per_gpu_batch = args.batch_size // world_size
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler, num_workers=workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=workers, pin_memory=True)
    train_labels = torch.tensor(train_set.targets, device=device)

    net = torchvision.models.__dict__[args.arch](num_classes=args.low_dim)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[gpu])
    bank = MemoryBank(len(train_set), args.low_dim, args.nce_m).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    start_epoch = 0
    ckpt_file = os.path.join(args.out, "last.pth")
    if os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location=device)
        net.load_state_dict(ckpt["net"])
        bank.load_state_dict(ckpt["bank"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        lr = args.lr * (0.1 ** sum(epoch >= m for m in (120, 160)))
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        t0 = time.time()
        for it, (img, _, idx) in enumerate(train_loader):
            img, idx = img.to(device, non_blocking=True), idx.to(device, non_blocking=True)
            feats = F.normalize(model(img), dim=1)
            loss = nce_softmax_loss(feats, idx, bank, args.nce_k, args.nce_t)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            bank.update(feats, idx)
            if it % 100 == 0 and rank == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.4f} lr {lr:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            acc = knn_top1(net, bank, train_labels, val_loader, args.knn_k, args.nce_t, device)
            if rank == 0:
                print(f"epoch {epoch}: kNN top-1 {100 * acc:.2f}", flush=True)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"net": net.state_dict(), "bank": bank.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_parser().parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


if __name__ == "__main__":
    main()
