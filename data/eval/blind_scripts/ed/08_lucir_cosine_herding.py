"""LUCIR-style class-incremental learning (cosine classifier + less-forget
feature distillation), herding exemplars, early stopping on a held-out split.

    torchrun --standalone --nproc_per_node=4 08_lucir_cosine_herding.py --nb_cl_fg 50 --nb_cl 10
    # resume after a crash:
    torchrun --standalone --nproc_per_node=4 08_lucir_cosine_herding.py --resume ckpt/lucir/task_3.pth
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


class CosineLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.uniform_(self.weight, -1.0 / math.sqrt(in_features), 1.0 / math.sqrt(in_features))

    def forward(self, x):
        return F.linear(F.normalize(x, dim=1), F.normalize(self.weight, dim=1))


class CosineNet(nn.Module):
    def __init__(self, n_first):
        super().__init__()
        bb = models.resnet18()
        bb.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        bb.maxpool, bb.fc = nn.Identity(), nn.Identity()
        self.backbone = bb
        self.pieces = nn.ModuleList([CosineLinear(512, n_first)])
        self.sigma = nn.Parameter(torch.tensor(10.0))

    def add_classes(self, n):
        self.pieces.append(CosineLinear(512, n))

    def features(self, x):
        return self.backbone(x)

    def forward(self, x):
        f = self.features(x)
        return self.sigma * torch.cat([p(f) for p in self.pieces], dim=1), f


@torch.no_grad()
def gather_features(net, dataset, indices, rank, world, device):
    """Every rank embeds a strided slice; the (index, feature) pairs are gathered as objects."""
    mine = indices[rank::world]
    loader = DataLoader(Subset(dataset, mine), batch_size=256, num_workers=4)
    net.eval()
    feats = [F.normalize(net.features(x.to(device)), dim=1).cpu() for x, _ in loader]
    feats = torch.cat(feats) if feats else torch.empty(0, 512)
    out = [None] * world
    dist.all_gather_object(out, (mine, feats))
    idx = [i for m, _ in out for i in m]
    order = np.argsort(idx)
    return np.asarray(idx)[order], torch.cat([f for _, f in out])[torch.from_numpy(order)]


def herding(feats, m):
    mu, acc, chosen = feats.mean(0), torch.zeros(feats.size(1)), []
    for k in range(1, min(m, len(feats)) + 1):
        d = ((mu - (acc + feats) / k) ** 2).sum(1)
        if chosen:
            d[chosen] = float("inf")
        chosen.append(int(d.argmin()))
        acc += feats[chosen[-1]]
    return chosen


@torch.no_grad()
def reduced_loss_acc(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits, _ = net(x)
        s += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum().float(),
                          torch.tensor(float(len(y)), device=device)])
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--ckpt_dir", default="./ckpt/lucir")
    ap.add_argument("--nb_cl_fg", type=int, default=50)
    ap.add_argument("--nb_cl", type=int, default=10)
    ap.add_argument("--nb_protos", type=int, default=20, help="exemplars per class")
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--patience", type=int, default=15)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch_size", type=int, default=128, help="global")
    ap.add_argument("--lamda_base", type=float, default=5.0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=1993)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize((0.5071, 0.4866, 0.4409), (0.2009, 0.1984, 0.2023))
    tr_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), norm])
    te_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_aug = datasets.CIFAR100(args.data, train=True, transform=tr_tf)
    train_plain = datasets.CIFAR100(args.data, train=True, transform=te_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=te_tf)
    remap = np.argsort(np.random.RandomState(args.seed).permutation(100))
    for ds in (train_aug, train_plain, test_set):
        ds.targets = remap[np.asarray(ds.targets)].tolist()
    y_tr, y_te = np.asarray(train_aug.targets), np.asarray(test_set.targets)
    split_rng = np.random.RandomState(args.seed)
    val_idx = np.concatenate([split_rng.choice(np.where(y_tr == c)[0], 50, replace=False) for c in range(100)])
    is_val = np.zeros(len(y_tr), dtype=bool)
    is_val[val_idx] = True

    bounds = [0] + list(range(args.nb_cl_fg, 101, args.nb_cl))
    n_tasks = len(bounds) - 1
    net, memory, start, acc = CosineNet(args.nb_cl_fg), {}, 0, np.zeros((n_tasks, n_tasks))
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        for _ in range(ckpt["task"]):
            net.add_classes(args.nb_cl)
        net.load_state_dict(ckpt["model"])
        memory, start, acc = ckpt["memory"], ckpt["task"] + 1, ckpt["acc"]
    ref_net = None
    if start > 0:
        ref_net = copy.deepcopy(net).to(device).eval().requires_grad_(False)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)

    for t in range(start, n_tasks):
        lo, hi = bounds[t], bounds[t + 1]
        if t > 0:
            net.add_classes(hi - lo)
            net.to(device)
        model = DDP(net, device_ids=[local_rank])
        new_idx = np.where((y_tr >= lo) & (y_tr < hi) & ~is_val)[0].tolist()
        train_data = Subset(train_aug, new_idx + [i for c in sorted(memory) for i in memory[c]])
        sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed)
        loader = DataLoader(train_data, batch_size=args.batch_size // world, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        val_data = Subset(train_plain, np.where(is_val & (y_tr < hi))[0][rank::world].tolist())
        val_loader = DataLoader(val_data, batch_size=256, num_workers=2)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
        lamda = args.lamda_base * math.sqrt(lo / (hi - lo)) if t > 0 else 0.0

        best, best_state, bad = float("inf"), None, 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits, feat = model(x)
                loss = F.cross_entropy(logits, y)
                if ref_net is not None:
                    with torch.no_grad():
                        _, ref_feat = ref_net(x)
                    loss = loss + lamda * (1 - F.cosine_similarity(feat, ref_feat.detach(), dim=1)).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            val_loss, val_acc = reduced_loss_acc(net, val_loader, device)
            if val_loss < best:
                best, best_state, bad = val_loss, copy.deepcopy(net.state_dict()), 0
            else:
                bad += 1
            if rank == 0 and epoch % 10 == 0:
                print(f"task {t} epoch {epoch} val loss {val_loss:.4f} acc {100 * val_acc:.2f}", flush=True)
            if bad >= args.patience:
                break
        net.load_state_dict(best_state)

        # herding on features gathered from all ranks -> same memory everywhere
        for c in memory:
            memory[c] = memory[c][:args.nb_protos]
        for c in range(lo, hi):
            cls_idx = np.where((y_tr == c) & ~is_val)[0].tolist()
            idx, feats = gather_features(model.module, train_plain, cls_idx, rank, world, device)
            memory[c] = [int(idx[i]) for i in herding(feats, args.nb_protos)]

        test_idx = np.where(y_te < hi)[0]
        test_loader = DataLoader(Subset(test_set, test_idx[rank::world].tolist()), batch_size=256, num_workers=2)
        hits = torch.zeros(t + 1, 2, device=device)
        model.module.eval()
        with torch.no_grad():
            for x, y in test_loader:
                pred = model.module(x.to(device))[0].argmax(1).cpu()
                for k in range(t + 1):
                    m = (y >= bounds[k]) & (y < bounds[k + 1])
                    hits[k, 0] += (pred[m] == y[m]).sum().item()
                    hits[k, 1] += m.sum().item()
        dist.all_reduce(hits)
        acc[t, :t + 1] = (100 * hits[:, 0] / hits[:, 1]).cpu().numpy()
        if rank == 0:
            print(f"== task {t} ({hi} classes) avg {acc[t, :t + 1].mean():.2f} per task {acc[t, :t + 1].round(1)}")
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"task": t, "model": model.module.state_dict(), "memory": memory, "acc": acc},
                       os.path.join(args.ckpt_dir, f"task_{t}.pth"))
        dist.barrier()
        ref_net = copy.deepcopy(model.module).eval().requires_grad_(False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
