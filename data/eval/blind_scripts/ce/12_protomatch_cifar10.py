"""FixMatch with prototype-refined pseudo-labels (CIFAR-10, 250 labels).

Class prototypes are an EMA of L2-normalised embeddings of confident unlabelled samples,
collected from all GPUs. Pseudo-labels blend classifier and prototype similarity.

torchrun --nproc_per_node=4 12_protomatch_cifar10.py --exp protomatch_250
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.models import resnet18


def get_opts():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exp", default="protomatch")
    ap.add_argument("--root", default="./data")
    ap.add_argument("--n-labels", type=int, default=250)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--mu", type=int, default=7)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--tau", type=float, default=0.95)
    ap.add_argument("--proto-m", type=float, default=0.99)
    ap.add_argument("--alpha", type=float, default=0.7, help="weight of classifier probs in the blend")
    ap.add_argument("--temp", type=float, default=0.1)
    ap.add_argument("--feat-dim", type=int, default=128)
    return ap.parse_args()


class Net(nn.Module):
    def __init__(self, num_classes=10, feat_dim=128):
        super().__init__()
        r = resnet18(num_classes=num_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        self.fc = r.fc
        r.fc = nn.Identity()
        self.encoder = r
        self.proj = nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, feat_dim))

    def forward(self, x):
        h = self.encoder(x)
        return self.fc(h), F.normalize(self.proj(h), dim=1)


class Prototypes:
    def __init__(self, num_classes, dim, momentum, device):
        self.protos = F.normalize(torch.randn(num_classes, dim, device=device), dim=1)
        dist.broadcast(self.protos, src=0)
        self.m = momentum

    @torch.no_grad()
    def update(self, feats, labels):
        world = dist.get_world_size()
        all_feats = [torch.zeros_like(feats) for _ in range(world)]
        all_labels = [torch.zeros_like(labels) for _ in range(world)]
        dist.all_gather(all_feats, feats)
        dist.all_gather(all_labels, labels)
        feats, labels = torch.cat(all_feats), torch.cat(all_labels)
        for c in labels.unique():
            mean_c = feats[labels == c].mean(0)
            self.protos[c] = F.normalize(self.m * self.protos[c] + (1 - self.m) * mean_c, dim=0)

    def similarity(self, feats, temp):
        return (feats @ self.protos.t() / temp).softmax(1)


class TwoView(Dataset):
    def __init__(self, base, idx, weak, strong):
        self.base, self.idx, self.weak, self.strong = base, idx, weak, strong

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        img, _ = self.base[self.idx[i]]
        return self.weak(img), self.strong(img)


class OneView(Dataset):
    def __init__(self, base, idx, tf):
        self.base, self.idx, self.tf = base, idx, tf

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        img, y = self.base[self.idx[i]]
        return self.tf(img), y


def loop_forever(loader, sampler):
    e = 0
    while True:
        sampler.set_epoch(e)
        yield from loader
        e += 1


def main():
    opt = get_opts()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616))
    weak = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4, padding_mode="reflect"),
                               transforms.ToTensor(), norm])
    strong = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4, padding_mode="reflect"),
                                 transforms.RandAugment(2, 10), transforms.ToTensor(), norm,
                                 transforms.RandomErasing(p=1.0, scale=(0.02, 0.1))])
    base = datasets.CIFAR10(opt.root, train=True)
    y = np.array(base.targets)
    lb_idx = np.concatenate([np.random.RandomState(c).choice(np.where(y == c)[0], opt.n_labels // 10, replace=False)
                             for c in range(10)])
    lb_idx = np.resize(lb_idx, max(len(lb_idx), opt.bs * world * 64))
    lb_ds = OneView(base, lb_idx, weak)
    ulb_ds = TwoView(base, np.arange(len(base)), weak, strong)
    test_ds = datasets.CIFAR10(opt.root, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))

    lb_sampler, ulb_sampler = DistributedSampler(lb_ds), DistributedSampler(ulb_ds)
    lb_stream = loop_forever(DataLoader(lb_ds, opt.bs, sampler=lb_sampler, num_workers=2, drop_last=True,
                                        pin_memory=True), lb_sampler)
    ulb_stream = loop_forever(DataLoader(ulb_ds, opt.bs * opt.mu, sampler=ulb_sampler, num_workers=6,
                                         drop_last=True, pin_memory=True), ulb_sampler)
    test_loader = DataLoader(test_ds, 500, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=2)

    model = Net(10, opt.feat_dim).to(dev)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: math.cos(7 * math.pi * s / (16 * opt.steps)))
    protos = Prototypes(10, opt.feat_dim, opt.proto_m, dev)

    out_dir = os.path.join("experiments", opt.exp)
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(out_dir)

    best = 0.0
    model.train()
    for step in range(1, opt.steps + 1):
        xl, yl = next(lb_stream)
        uw, us = next(ulb_stream)
        n = xl.size(0)
        logits, feats = model(torch.cat([xl, uw, us]).to(dev, non_blocking=True))
        yl = yl.to(dev, non_blocking=True)
        logits_w, logits_s = logits[n:].chunk(2)
        feats_w = feats[n:].chunk(2)[0]

        with torch.no_grad():
            p_cls = logits_w.softmax(1)
            p_proto = protos.similarity(feats_w.detach(), opt.temp)
            p = opt.alpha * p_cls + (1 - opt.alpha) * p_proto
            conf, pseudo = p.max(1)
            mask = conf >= opt.tau

        loss_x = F.cross_entropy(logits[:n], yl)
        loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask.float()).mean()
        loss = loss_x + loss_u
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        protos.update(feats_w.detach()[mask], pseudo[mask])

        if writer is not None and step % 100 == 0:
            writer.add_scalar("train/loss_x", loss_x.item(), step)
            writer.add_scalar("train/loss_u", loss_u.item(), step)
            writer.add_scalar("train/mask", mask.float().mean().item(), step)

        if step % opt.eval_every == 0:
            model.eval()
            tot = torch.zeros(2, device=dev)
            with torch.no_grad():
                for x, t in test_loader:
                    out, _ = model(x.to(dev))
                    tot[0] += (out.argmax(1) == t.to(dev)).sum()
                    tot[1] += t.numel()
            dist.all_reduce(tot)
            acc = (tot[0] / tot[1]).item()
            if rank == 0:
                writer.add_scalar("test/acc", acc, step)
                print(f"step {step} test acc {acc:.4f}", flush=True)
                ckpt = {"step": step, "model": model.module.state_dict(), "protos": protos.protos.cpu(),
                        "optim": optim.state_dict(), "sched": sched.state_dict()}
                torch.save(ckpt, os.path.join(out_dir, "last.pth"))
                if acc > best:
                    best = acc
                    torch.save(ckpt, os.path.join(out_dir, "best.pth"))
            model.train()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
