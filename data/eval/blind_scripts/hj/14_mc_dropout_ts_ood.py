"""MC-dropout WRN-16-4 + temperature scaling, evaluated in- and out-of-distribution.

1. train a dropout WRN on CIFAR-10 (DDP, gradient accumulation),
2. MC-dropout predictive on a held-out validation split; fit a temperature,
3. report test accuracy / NLL / ECE and OOD AUROC (CIFAR-10 vs SVHN) using
   the predictive entropy.

    torchrun --nproc_per_node=4 14_mc_dropout_ts_ood.py --data /data --accum 2
"""
import argparse
import contextlib
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms as T


class Block(nn.Module):
    def __init__(self, cin, cout, stride, p):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.drop = nn.Dropout(p)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = nn.Conv2d(cin, cout, 1, stride, bias=False) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        o = F.relu(self.bn1(x))
        sc = x if self.short is None else self.short(o)
        o = self.conv2(F.relu(self.bn2(self.drop(self.conv1(o)))))
        return o + sc


class DropoutWRN(nn.Module):
    def __init__(self, depth=16, k=4, p=0.3, num_classes=10):
        super().__init__()
        n = (depth - 4) // 6
        w = [16, 16 * k, 32 * k, 64 * k]
        blocks, cin = [], w[0]
        self.conv = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        for i, s in enumerate((1, 2, 2)):
            for j in range(n):
                blocks.append(Block(cin, w[i + 1], s if j == 0 else 1, p))
                cin = w[i + 1]
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.head = nn.Sequential(nn.Dropout(p), nn.Linear(cin, num_classes))

    def forward(self, x):
        h = F.relu(self.bn(self.blocks(self.conv(x))))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))

    def enable_dropout(self):
        """Eval mode for BN, train mode for dropout."""
        self.eval()
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.train()


@torch.no_grad()
def mc_log_probs(net, loader, device, T):
    """log of the MC-averaged predictive for this rank's (padded) shard."""
    net.enable_dropout()
    out, labels = [], []
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        p = torch.stack([F.softmax(net(x), -1) for _ in range(T)]).mean(0)
        out.append(p.clamp_min(1e-12).log())
        labels.append(y.to(device))
    return torch.cat(out), torch.cat(labels)


def gather_ordered(t, n_total):
    """Undo DistributedSampler(shuffle=False) sharding: local j of rank r is global j*W + r."""
    world = dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    stacked = torch.stack(parts, dim=1)  # [n_local, W, ...]
    return stacked.reshape(-1, *t.shape[1:])[:n_total]


def ece(probs, labels, n_bins=15):
    conf, pred = probs.max(1)
    hit = pred.eq(labels).float()
    b = (conf * n_bins).long().clamp(max=n_bins - 1)
    gap = torch.zeros(n_bins, device=probs.device).index_add_(0, b, conf - hit)
    return (gap.abs().sum() / len(labels)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data")
    ap.add_argument("--out", default="runs/mcd_wrn")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--p", type=float, default=0.3)
    ap.add_argument("--mc", type=int, default=30)
    ap.add_argument("--val-size", type=int, default=5000)
    ap.add_argument("--ckpt", default="", help="skip training, load this checkpoint")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.ToTensor(), norm])
    c10 = os.path.join(args.data, "cifar10")
    split = torch.randperm(50000, generator=torch.Generator().manual_seed(2024)).tolist()
    train_set = Subset(datasets.CIFAR10(c10, True, aug), split[args.val_size:])
    val_set = Subset(datasets.CIFAR10(c10, True, plain), split[:args.val_size])
    test_set = datasets.CIFAR10(c10, False, plain)
    ood_set = datasets.SVHN(os.path.join(args.data, "svhn"), split="test", transform=plain)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    eval_loader = lambda ds: DataLoader(ds, 500, sampler=DistributedSampler(ds, shuffle=False),
                                        num_workers=4, pin_memory=True)

    net = DropoutWRN(16, 4, args.p).to(device)
    ddp = DDP(net, device_ids=[local_rank])
    # global batch = batch_size * accum * world; reference lr 0.1 at 128
    lr = args.lr * args.batch_size * args.accum * world / 128
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)

    if args.ckpt:
        net.load_state_dict(torch.load(args.ckpt, map_location=device)["model"])
    else:
        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)
            ddp.train()
            opt.zero_grad(set_to_none=True)
            n_batches = len(train_loader)
            for i, (x, y) in enumerate(train_loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sync = (i + 1) % args.accum == 0 or i + 1 == n_batches
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    loss = F.cross_entropy(ddp(x), y) / args.accum
                    loss.backward()
                if sync:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            sched.step()
            if rank == 0 and epoch % 10 == 0:
                print(f"epoch {epoch} last loss {loss.item() * args.accum:.4f}", flush=True)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "args": vars(args)}, os.path.join(args.out, "model.pt"))

    # ------------------------------------------------------------------ evaluation
    # BN running stats drift apart slightly between replicas (each rank's last
    # batches); evaluate every shard with rank 0's statistics
    for buf in net.buffers():
        dist.broadcast(buf, src=0)
    torch.manual_seed(1000 + rank)  # independent dropout masks on each shard
    logp = {}
    for name, ds in (("val", val_set), ("test", test_set), ("ood", ood_set)):
        lp, y = mc_log_probs(net, eval_loader(ds), device, args.mc)
        logp[name] = (gather_ordered(lp, len(ds)), gather_ordered(y, len(ds)))

    temp = torch.ones(1, device=device)
    if rank == 0:
        lv, yv = logp["val"]
        log_t = torch.zeros(1, device=device, requires_grad=True)
        opt_t = torch.optim.LBFGS([log_t], lr=0.1, max_iter=100)

        def closure():
            opt_t.zero_grad()
            l = F.cross_entropy(lv / log_t.exp(), yv)
            l.backward()
            return l

        opt_t.step(closure)
        temp = log_t.detach().exp()
    dist.broadcast(temp, src=0)

    if rank == 0:
        lt, yt = logp["test"]
        lo, _ = logp["ood"]
        for tag, t in (("raw", 1.0), ("ts", temp.item())):
            pt, po = F.softmax(lt / t, -1), F.softmax(lo / t, -1)
            ent_in = -(pt * pt.clamp_min(1e-12).log()).sum(1)
            ent_out = -(po * po.clamp_min(1e-12).log()).sum(1)
            scores = torch.cat([ent_in, ent_out]).cpu().numpy()
            is_ood = np.r_[np.zeros(len(ent_in)), np.ones(len(ent_out))]
            print(f"[{tag}] T={t:.3f} acc {pt.argmax(1).eq(yt).float().mean().item():.4f} "
                  f"nll {F.nll_loss(pt.clamp_min(1e-12).log(), yt).item():.4f} ece {ece(pt, yt):.4f} "
                  f"ood_auroc {roc_auc_score(is_ood, scores):.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
