"""SimCLR (ResNet-50, 3-layer projection head, LARS) with NT-Xent over the
global batch: every rank contrasts its views against the embeddings of all ranks.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        simclr.py --data /datasets/imagenet --batch-size 128 --epochs 800
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class LARS(torch.optim.Optimizer):
    """SGD + momentum with layer-wise trust ratio; biases and BN params are excluded via their group."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=1e-6, eta=1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, lars=True))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if g["lars"]:
                    d = d.add(p, alpha=g["weight_decay"])
                    pn, dn = torch.norm(p), torch.norm(d)
                    q = torch.where((pn > 0) & (dn > 0), g["eta"] * pn / dn, torch.ones_like(pn))
                    d = d.mul(q)
                buf = self.state[p].setdefault("mu", torch.zeros_like(p))
                buf.mul_(g["momentum"]).add_(d)
                p.add_(buf, alpha=-g["lr"])


class SimCLR(nn.Module):
    def __init__(self, out_dim=128):
        super().__init__()
        self.backbone = torchvision.models.resnet50(zero_init_residual=True)
        feat = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.head = nn.Sequential(
            nn.Linear(feat, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, 2048, bias=False), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, out_dim, bias=False), nn.BatchNorm1d(out_dim, affine=False))

    def forward(self, x):
        return self.head(self.backbone(x))


def nt_xent(z1, z2, temperature, rank):
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    all_z1 = torch.cat(torch.distributed.nn.functional.all_gather(z1))
    all_z2 = torch.cat(torch.distributed.nn.functional.all_gather(z2))
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    masks = F.one_hot(labels, all_z1.size(0)).float() * 1e9
    l_ab = z1 @ all_z2.T / temperature
    l_aa = z1 @ all_z1.T / temperature - masks
    l_ba = z2 @ all_z1.T / temperature
    l_bb = z2 @ all_z2.T / temperature - masks
    loss_a = F.cross_entropy(torch.cat([l_ab, l_aa], 1), labels)
    loss_b = F.cross_entropy(torch.cat([l_ba, l_bb], 1), labels)
    acc = (l_ab.argmax(1) == labels).float().mean()
    return (loss_a + loss_b) / 2, acc


class TwoAug:
    def __init__(self, size=224, s=1.0):
        jitter = T.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)
        self.t = T.Compose([
            T.RandomResizedCrop(size, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
            T.RandomApply([jitter], p=0.8), T.RandomGrayscale(p=0.2),
            T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
            T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __call__(self, x):
        return self.t(x), self.t(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--base-lr", type=float, default=0.3, help="lr = base_lr * global_batch / 256")
    ap.add_argument("--wd", type=float, default=1e-6)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--ckpt", default="ckpt/simclr_r50")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), TwoAug())
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), TwoAug())
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=args.workers, drop_last=True)

    model = SimCLR().to(device)
    model = DDP(model, device_ids=[local_rank])

    lars_params = [p for n, p in model.named_parameters() if p.ndim > 1]
    plain_params = [p for n, p in model.named_parameters() if p.ndim <= 1]
    lr = args.base_lr * args.batch_size * world / 256
    opt = LARS([{"params": lars_params}, {"params": plain_params, "lars": False, "weight_decay": 0.0}], lr=lr,
               weight_decay=args.wd)
    steps_per_epoch = len(loader)
    total, warm = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch

    start_epoch = 0
    last = os.path.join(args.ckpt, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        print(f"global batch {args.batch_size * world}, peak lr {lr:.3f}, {steps_per_epoch} steps/epoch")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, ((x1, x2), _) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            cur = lr * step / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in opt.param_groups:
                g["lr"] = cur
            x1, x2 = x1.to(device, non_blocking=True), x2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z1, z2 = model(torch.cat([x1, x2])).float().chunk(2)
            loss, acc = nt_xent(z1, z2, args.temperature, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i % 100 == 0:
                s = torch.stack([loss.detach(), acc.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} {i}/{steps_per_epoch} loss {s[0]:.4f} acc {s[1]:.3f} lr {cur:.4f} "
                          f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        if epoch % 10 == 0 or epoch == args.epochs - 1:
            model.eval()
            tot = torch.zeros(3, device=device)
            with torch.no_grad():
                for (x1, x2), _ in val_loader:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        z1, z2 = model(torch.cat([x1, x2]).to(device)).float().chunk(2)
                    l, a = nt_xent(z1, z2, args.temperature, rank)
                    tot += torch.stack([l, a, torch.ones_like(l)])
            dist.all_reduce(tot)
            if rank == 0:
                print(f"[val] epoch {epoch} loss {(tot[0] / tot[2]).item():.4f} acc {(tot[1] / tot[2]).item():.3f}")
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
