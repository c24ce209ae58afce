"""SHOT: source hypothesis transfer (Liang et al., ICML'20), multi-GPU.

Takes the source model (feature extractor + bottleneck + classifier), freezes the
classifier ("hypothesis") and adapts the rest on unlabelled target data with the
information-maximisation loss plus self-supervised pseudo-labels from
class-centroid clustering, recomputed every epoch.

    torchrun --nproc_per_node=4 16_shot_source_free.py --root data/office-home \
        --target Clipart --source-model weights/Art_source.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class IndexedFolder(Dataset):
    def __init__(self, root, transform):
        self.ds = datasets.ImageFolder(root, transform)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


class SHOTNet(nn.Module):
    def __init__(self, num_classes, bottleneck=256):
        super().__init__()
        r = models.resnet50(weights=None)
        r.fc = nn.Identity()
        self.netF = r
        self.netB = nn.Sequential(nn.Linear(2048, bottleneck), nn.BatchNorm1d(bottleneck))
        self.netC = weight_norm(nn.Linear(bottleneck, num_classes), name="weight")

    def features(self, x):
        return self.netB(self.netF(x))

    def forward(self, x):
        f = self.features(x)
        return self.netC(f), f


def im_loss(logits, eps=1e-5):
    p = F.softmax(logits, 1)
    ent = -(p * torch.log(p + eps)).sum(1).mean()
    p_mean = p.mean(0)
    div = (p_mean * torch.log(p_mean + eps)).sum()
    return ent + div


@torch.no_grad()
def cluster_pseudo_labels(model, loader, num_classes, n_total, device, threshold=0):
    """SHOT's weighted k-means on the cosine-normalised features, over all ranks."""
    model.eval()
    feats, probs, idxs = [], [], []
    for x, _, idx in loader:
        logits, f = model(x.to(device, non_blocking=True))
        f = torch.cat([f, torch.ones(f.size(0), 1, device=device)], 1)
        feats.append(F.normalize(f, dim=1))
        probs.append(F.softmax(logits, 1))
        idxs.append(idx.to(device))
    feats, probs, idxs = torch.cat(feats), torch.cat(probs), torch.cat(idxs)

    num = probs.t() @ feats
    den = probs.sum(0)
    dist.all_reduce(num)
    dist.all_reduce(den)
    centroids = num / (den[:, None] + 1e-8)
    labels = (feats @ F.normalize(centroids, dim=1).t()).argmax(1)

    for _ in range(1):
        onehot = F.one_hot(labels, num_classes).float()
        num = onehot.t() @ feats
        cnt = onehot.sum(0)
        dist.all_reduce(num)
        dist.all_reduce(cnt)
        valid = cnt > threshold
        centroids = num / (cnt[:, None] + 1e-8)
        sim = feats @ F.normalize(centroids, dim=1).t()
        sim[:, ~valid] = -1e4
        labels = sim.argmax(1)

    world = dist.get_world_size()
    g_idx = [torch.zeros_like(idxs) for _ in range(world)]
    g_lab = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(g_idx, idxs)
    dist.all_gather(g_lab, labels)
    table = torch.full((n_total,), -1, dtype=torch.long, device=device)
    table[torch.cat(g_idx)] = torch.cat(g_lab)
    model.train()
    return table


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y, _ in loader:
        logits, _ = model(x.to(device, non_blocking=True))
        s[0] += (logits.argmax(1) == y.to(device)).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return 100 * (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/office-home")
    ap.add_argument("--target", default="Clipart")
    ap.add_argument("--source-model", required=True)
    ap.add_argument("--num-classes", type=int, default=65)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--cls-par", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="results/shot")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2020)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    domain_dir = os.path.join(args.root, args.target)
    train_set = IndexedFolder(domain_dir, train_tf)
    eval_set = IndexedFolder(domain_dir, test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, args.batch_size * 2, sampler=DistributedSampler(eval_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = SHOTNet(args.num_classes)
    source_state = torch.load(args.source_model)
    model.load_state_dict(source_state["model"])
    model.netC.requires_grad_(False)
    model = model.to(device)

    optimizer = torch.optim.SGD([
        {"params": model.netF.parameters(), "lr": args.lr * 0.1},
        {"params": model.netB.parameters(), "lr": args.lr},
    ], momentum=0.9, weight_decay=1e-3, nesterov=True)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    ddp = DDP(model, device_ids=[local_rank])

    acc = accuracy(ddp, eval_loader, device)
    if rank == 0:
        print(f"source model on {args.target}: {acc:.2f}", flush=True)
        os.makedirs(args.out, exist_ok=True)

    max_iter = args.epochs * len(train_loader)
    it = 0
    for epoch in range(args.epochs):
        pseudo = cluster_pseudo_labels(ddp, eval_loader, args.num_classes, len(eval_set), device)
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, _, idx in train_loader:
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr * (1 + 10 * it / max_iter) ** -0.75
            x = x.to(device, non_blocking=True)
            logits, _ = ddp(x)
            target = pseudo[idx.to(device)]
            loss = im_loss(logits) + args.cls_par * F.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

        acc = accuracy(ddp, eval_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: target acc {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.out, f"{args.target}_shot.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
