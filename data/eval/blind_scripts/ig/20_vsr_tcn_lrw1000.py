"""Word-level lip reading on LRW-1000 (CAS-VSR-W1k, 1000 Mandarin words), ResNet-18 + multi-scale TCN.

The 3D/2D frontend is initialised from our English LRW model (same ROI size); the TCN and classifier
are trained from scratch. Clips are variable length (word boundaries + 0.1 s context), so the backend
pools over valid frames only.

    torchrun --nproc_per_node=8 20_vsr_tcn_lrw1000.py --data /data/LRW1000 \
        --frontend-init pretrained/lrw_resnet18_mstcn.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--frontend-init", default=None)
    p.add_argument("--out", default="runs/lrw1000_mstcn")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-len", type=int, default=40)
    return p.parse_args()


class LRW1000(Dataset):
    """index file lines: <npy path>,<label id>,<n frames>"""

    def __init__(self, root, split, max_len, train):
        self.root, self.max_len, self.train = root, max_len, train
        with open(os.path.join(root, f"{split}_index.csv")) as f:
            self.items = [(p, int(lab), int(n)) for p, lab, n in (l.strip().split(",") for l in f if l.strip())]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label, _ = self.items[i]
        x = np.load(os.path.join(self.root, path)).astype(np.float32) / 255.0   # T, 96, 96 gray
        x = x[: self.max_len]
        if self.train:
            oy, ox = np.random.randint(0, 9, 2)
            x = x[:, oy:oy + 88, ox:ox + 88]
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
        else:
            x = x[:, 4:92, 4:92]
        x = (np.ascontiguousarray(x) - 0.421) / 0.165
        return torch.from_numpy(x), label


def collate(batch):
    xs, ys = zip(*batch)
    lens = torch.tensor([x.size(0) for x in xs])
    return nn.utils.rnn.pad_sequence(xs, batch_first=True), lens, torch.tensor(ys)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu1, self.relu2 = nn.PReLU(cout), nn.PReLU(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        r = x if self.downsample is None else self.downsample(x)
        x = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(x)) + r)


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend3D = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                        nn.BatchNorm3d(64), nn.PReLU(64), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        chans, layers = [64, 64, 128, 256, 512], []
        for i in range(4):
            layers += [BasicBlock(chans[i], chans[i + 1], 1 if i == 0 else 2), BasicBlock(chans[i + 1], chans[i + 1])]
        self.trunk = nn.Sequential(*layers)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.frontend3D(x.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return F.adaptive_avg_pool2d(self.trunk(x), 1).view(b, t, 512)


class MultiscaleTCNBlock(nn.Module):
    def __init__(self, c, kernels=(3, 5, 7), dilation=1, dropout=0.2):
        super().__init__()
        branch_c = c // len(kernels)
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv1d(c, branch_c, k, padding=dilation * (k - 1) // 2, dilation=dilation),
                          nn.BatchNorm1d(branch_c), nn.PReLU(branch_c), nn.Dropout(dropout))
            for k in kernels])
        self.merge = nn.Conv1d(branch_c * len(kernels), c, 1)

    def forward(self, x):
        return F.relu(x + self.merge(torch.cat([b(x) for b in self.branches], 1)))


class LipWordNet(nn.Module):
    def __init__(self, n_classes=1000, c=768):
        super().__init__()
        self.frontend = Frontend()
        self.inp = nn.Conv1d(512, c, 1)
        self.tcn = nn.Sequential(*[MultiscaleTCNBlock(c, dilation=2 ** i) for i in range(4)])
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x, lens):
        h = self.tcn(self.inp(self.frontend(x).transpose(1, 2)))           # B, C, T
        mask = (torch.arange(h.size(2), device=h.device)[None] < lens[:, None]).unsqueeze(1).float()
        return self.fc((h * mask).sum(2) / mask.sum(2))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    train_ds = LRW1000(args.data, "trn", args.max_len, train=True)
    val_ds = LRW1000(args.data, "val", args.max_len, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size, num_workers=args.workers,
                        collate_fn=collate)

    model = LipWordNet()
    if args.frontend_init:
        ckpt = torch.load(args.frontend_init, map_location="cuda:0")
        state = ckpt.get("model_state_dict", ckpt)
        fe = {k[len("frontend."):]: v for k, v in state.items() if k.startswith("frontend.")}
        model.frontend.load_state_dict(fe)
        if rank == 0:
            print(f"frontend initialised from {args.frontend_init} ({len(fe)} tensors)")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW([
        {"params": model.module.frontend.parameters(), "lr": args.lr * 0.5},
        {"params": list(model.module.inp.parameters()) + list(model.module.tcn.parameters()) +
                   list(model.module.fc.parameters())},
    ], lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-6)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    writer = SummaryWriter(args.out) if rank == 0 else None

    best, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, lens, y in train_dl:
            x, lens, y = x.to(device, non_blocking=True), lens.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x, lens).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, lens, y in val_dl:
                logits = model.module(x.to(device), lens.to(device))
                acc[0] += (logits.argmax(1) == y.to(device)).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        top1 = (acc[0] / acc[1]).item()
        if rank == 0:
            writer.add_scalar("val/top1", top1, epoch)
            print(f"epoch {epoch}: val top-1 {100 * top1:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            state = {"model_state_dict": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                     "top1": top1}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
