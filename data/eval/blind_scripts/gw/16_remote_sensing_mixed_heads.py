"""Remote-sensing scene classification over four datasets with one ResNet-50 trunk.

EuroSAT (RGB), NWPU-RESISC45, UC Merced and AID are pooled into one training
set; examples are sampled in proportion to dataset size, so a batch mixes tasks.
Each example is routed to its own dataset's head.

    torchrun --nproc_per_node=4 rs_mtl.py --root /data/remote_sensing --epochs 60
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset
from torchvision import transforms as T

DATASETS = ["eurosat", "resisc45", "ucmerced", "aid"]


class WithTask(Dataset):
    def __init__(self, ds, task_id):
        self.ds, self.task_id = ds, task_id

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, self.task_id


class RSNet(nn.Module):
    def __init__(self, classes):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        r.fc = nn.Identity()
        self.trunk = r
        self.heads = nn.ModuleList([nn.Linear(2048, c) for c in classes])

    def forward(self, x, tids):
        f = self.trunk(x)
        out = {}
        for t in tids.unique().tolist():
            m = tids == t
            out[t] = (self.heads[t](f[m]), m)
        return out


def build(root, train):
    aug = [T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
           T.RandomApply([T.RandomRotation((90, 90))], p=0.5)] if train else [T.Resize(256), T.CenterCrop(224)]
    tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    split = "train" if train else "test"
    return [torchvision.datasets.ImageFolder(os.path.join(root, d, split), tf) for d in DATASETS]


@torch.no_grad()
def evaluate(net, test_sets, device, rank, world):
    net.eval()
    c = torch.zeros(len(test_sets), 2, device=device)
    for t, ds in enumerate(test_sets):
        for x, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, num_workers=6):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            c[t, 0] += (net.heads[t](net.trunk(x)).argmax(1) == y).sum()
            c[t, 1] += len(y)
    dist.all_reduce(c)
    net.train()
    return (c[:, 0] / c[:, 1]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05, help="for a global batch of 256")
    ap.add_argument("--wd", type=float, default=5e-5)
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--ckpt_dir", default="checkpoints/rs_mtl")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_parts = build(args.root, train=True)
    test_sets = build(args.root, train=False)
    classes = [len(d.classes) for d in train_parts]
    train_all = ConcatDataset([WithTask(d, i) for i, d in enumerate(train_parts)])
    sampler = DistributedSampler(train_all, shuffle=True, drop_last=True)
    loader = DataLoader(train_all, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(RSNet(classes)).to(device)
    # a batch may miss a dataset entirely, leaving that head without gradient
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    iters = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=iters, pct_start=0.05)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, tids in loader:
            x, y, tids = x.to(device, non_blocking=True), y.to(device, non_blocking=True), tids.to(device)
            out = model(x, tids)
            task_losses = {t: F.cross_entropy(logits, y[m], label_smoothing=0.1) for t, (logits, m) in out.items()}
            loss = sum(l * out[t][1].sum() for t, l in task_losses.items()) / len(y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            if step % args.log_every == 0:
                report = {}
                for t, l in task_losses.items():
                    v = l.detach().clone()
                    dist.all_reduce(v, op=dist.ReduceOp.AVG)
                    report[DATASETS[t]] = round(v.item(), 4)
                if rank == 0:
                    print(f"ep {epoch} step {step} {report} lr {sched.get_last_lr()[0]:.4f}", flush=True)

        accs = evaluate(net, test_sets, device, rank, world)
        oa = sum(accs) / len(accs)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " +
                  " ".join(f"{d}={a:.4f}" for d, a in zip(DATASETS, accs)) + f" mean={oa:.4f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, "last.pth"))
            if oa > best:
                best = oa
                torch.save(net.state_dict(), os.path.join(args.ckpt_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
