"""DER++ (Buzzega et al., NeurIPS 2020) on Seq-CIFAR-100 (10 tasks), multi-GPU.

Three forward passes per step as in the reference implementation: stream batch,
buffer batch for the logit-matching term, and a second buffer batch for the
label term. BatchNorm layers are SyncBatchNorm so the running statistics stay
identical on every rank, which is why DDP does not need to re-broadcast buffers.

    torchrun --nproc_per_node=4 17_derpp_syncbn_wandb.py --alpha 0.1 --beta 0.5 --buffer_size 2000
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

MEAN = (0.5071, 0.4865, 0.4409)
STD = (0.2673, 0.2564, 0.2762)


class SeqCIFAR100(Dataset):
    def __init__(self, root, classes, train):
        base = torchvision.datasets.CIFAR100(root, train=train)
        y = np.asarray(base.targets)
        keep = np.isin(y, classes)
        self.x, self.y = base.data[keep], y[keep]
        self.train = train
        self.aug = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip()])
        self.norm = transforms.Normalize(MEAN, STD)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = torch.from_numpy(self.x[i]).permute(2, 0, 1).float().div(255)
        x = self.norm(self.aug(img) if self.train else img)
        return x, int(self.y[i]), img


class LogitBuffer:
    def __init__(self, size, n_classes, device):
        self.size, self.seen = size, 0
        self.x = torch.zeros(size, 3, 32, 32, device=device)
        self.y = torch.zeros(size, dtype=torch.long, device=device)
        self.z = torch.zeros(size, n_classes, device=device)
        self.aug = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                       transforms.Normalize(MEAN, STD)])

    def __len__(self):
        return min(self.seen, self.size)

    def add(self, x, y, z):
        for i in range(len(y)):
            j = self.seen if self.seen < self.size else np.random.randint(0, self.seen + 1)
            if j < self.size:
                self.x[j], self.y[j], self.z[j] = x[i], y[i], z[i]
            self.seen += 1

    def get(self, n):
        idx = torch.from_numpy(np.random.choice(len(self), min(n, len(self)), replace=False)).to(self.x.device)
        return torch.stack([self.aug(im) for im in self.x[idx]]), self.y[idx], self.z[idx]


def resnet18(n_classes):
    m = torchvision.models.resnet18(num_classes=n_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def evaluate(net, root, tasks, rank, world, device):
    net.eval()
    res = torch.zeros(len(tasks), 2, device=device)
    n_seen = sum(len(c) for c in tasks)
    for k, classes in enumerate(tasks):
        ds = SeqCIFAR100(root, classes, train=False)
        shard = torch.utils.data.Subset(ds, list(range(rank, len(ds), world)))
        for x, y, _ in DataLoader(shard, batch_size=500, num_workers=2):
            x, y = x.to(device), y.to(device)
            res[k, 0] += (net(x)[:, :n_seen].argmax(1) == y).sum()
            res[k, 1] += len(y)
    dist.all_reduce(res)
    return (100 * res[:, 0] / res[:, 1]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./output/derpp")
    ap.add_argument("--n_tasks", type=int, default=10)
    ap.add_argument("--n_epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=32, help="global stream batch")
    ap.add_argument("--minibatch_size", type=int, default=32, help="global replay batch")
    ap.add_argument("--buffer_size", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb_project", default="derpp-ddp")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world})
        os.makedirs(args.out, exist_ok=True)

    cpt = 100 // args.n_tasks
    tasks = [list(range(t * cpt, (t + 1) * cpt)) for t in range(args.n_tasks)]
    net = nn.SyncBatchNorm.convert_sync_batchnorm(resnet18(100)).to(device)
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    buf = LogitBuffer(args.buffer_size // world, 100, device)
    bs, mbs = args.batch_size // world, args.minibatch_size // world
    acc = np.zeros((args.n_tasks, args.n_tasks))
    step = 0

    for t, classes in enumerate(tasks):
        ds = SeqCIFAR100(args.data, classes, train=True)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
        for epoch in range(args.n_epochs):
            sampler.set_epoch(epoch)
            model.train()
            tot = torch.zeros(2, device=device)
            for x, y, raw in loader:
                x, y, raw = x.to(device, non_blocking=True), y.to(device, non_blocking=True), raw.to(device)
                opt.zero_grad(set_to_none=True)
                out = model(x)
                loss = F.cross_entropy(out, y)
                if len(buf) > 0:
                    bx, _, bz = buf.get(mbs)
                    loss = loss + args.alpha * F.mse_loss(model(bx), bz)
                    bx2, by2, _ = buf.get(mbs)
                    loss = loss + args.beta * F.cross_entropy(model(bx2), by2)
                loss.backward()
                opt.step()
                buf.add(raw, y, out.detach())
                tot += torch.stack([loss.detach(), torch.ones((), device=device)])
                step += 1
            dist.all_reduce(tot)
            if rank == 0:
                wandb.log({"train/loss": (tot[0] / tot[1]).item(), "task": t, "epoch": epoch}, step=step)

        acc[t, :t + 1] = evaluate(model.module, args.data, tasks[:t + 1], rank, world, device)
        if rank == 0:
            print(f"task {t}: class-IL acc {acc[t, :t + 1].mean():.2f}", flush=True)
            wandb.log({"eval/class_il": acc[t, :t + 1].mean(),
                       **{f"eval/task_{j}": acc[t, j] for j in range(t + 1)}}, step=step)
            torch.save({"model": model.module.state_dict(), "task": t, "acc": acc},
                       os.path.join(args.out, f"derpp_task{t}.pt"))
        dist.barrier()

    if rank == 0:
        fgt = np.mean([acc[:-1, j].max() - acc[-1, j] for j in range(args.n_tasks - 1)])
        wandb.summary["final_acc"] = acc[-1].mean()
        wandb.summary["forgetting"] = fgt
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
