"""CTR-GCN, one stream of the 4-stream NTU-120 ensemble, with AMP and gradient accumulation.

    torchrun --nproc_per_node=8 20_ctrgcn_bm_amp_accum_ensemble.py --stream bm --accum 2

The effective batch is per_gpu * world * accum; the LR is scaled to it.
When the other streams' score files already exist in --ensemble-dir the script
also reports the fused J+B+JM+BM accuracy at the end.
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PAIRS = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
         (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
         (22, 23), (23, 8), (24, 25), (25, 12)]
STREAM_WEIGHTS = {"j": 0.6, "b": 0.6, "jm": 0.4, "bm": 0.4}


class StreamData(Dataset):
    def __init__(self, root, split, stream, window=64, train=False):
        self.x = np.load(os.path.join(root, f"{split}_data_joint.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_label.npy")).astype(np.int64)
        self.stream, self.window, self.train = stream, window, train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = np.array(self.x[i], dtype=np.float32)
        t = max(int(np.any(x, axis=(0, 2, 3)).sum()), 1)
        if self.train:
            crop = max(int(t * np.random.uniform(0.5, 1.0)), 1)
            s = np.random.randint(0, t - crop + 1)
        else:
            crop, s = t, 0
        x = x[:, np.linspace(s, s + crop - 1, self.window).round().astype(np.int64)]
        if "b" in self.stream:
            bone = np.zeros_like(x)
            for a, b in PAIRS:
                bone[:, :, a - 1] = x[:, :, a - 1] - x[:, :, b - 1]
            x = bone
        if self.stream.endswith("m"):
            x[:, :-1] = x[:, 1:] - x[:, :-1]
            x[:, -1] = 0
        return torch.from_numpy(x), self.y[i]


def graph():
    I = np.eye(25, dtype=np.float32)
    inw = np.zeros((25, 25), dtype=np.float32)
    for a, b in PAIRS:
        inw[b - 1, a - 1] = 1
    outw = inw.T.copy()
    nrm = lambda m: m / np.maximum(m.sum(0, keepdims=True), 1)
    return np.stack([I, nrm(inw), nrm(outw)])


class CTRGC(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        rel = 8 if cin <= 16 else cin // 8
        self.c1, self.c2 = nn.Conv2d(cin, rel, 1), nn.Conv2d(cin, rel, 1)
        self.c3, self.c4 = nn.Conv2d(cin, cout, 1), nn.Conv2d(rel, cout, 1)

    def forward(self, x, A, alpha):
        r = torch.tanh(self.c1(x).mean(-2).unsqueeze(-1) - self.c2(x).mean(-2).unsqueeze(-2))
        r = self.c4(r) * alpha + A
        return torch.einsum("ncuv,nctv->nctu", r, self.c3(x))


class Unit(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.PA = nn.Parameter(torch.from_numpy(A).clone())
        self.alpha = nn.Parameter(torch.zeros(1))
        self.convs = nn.ModuleList([CTRGC(cin, cout) for _ in range(3)])
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = sum(c(x, self.PA[k], self.alpha) for k, c in enumerate(self.convs))
        y = F.relu(self.bn(y) + self.down(x))
        return F.relu(self.tcn(y) + self.res(x))


class CTRGCN(nn.Module):
    def __init__(self, num_class=120, grad_ckpt=False):
        super().__init__()
        A = graph()
        self.data_bn = nn.BatchNorm1d(2 * 3 * 25)
        plan = [(3, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1),
                (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.units = nn.ModuleList([Unit(a, b, A, s) for a, b, s in plan])
        self.fc = nn.Linear(256, num_class)
        self.grad_ckpt = grad_ckpt

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, -1, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for u in self.units:
            x = checkpoint(u, x, use_reentrant=False) if self.grad_ckpt and self.training else u(x)
        return self.fc(x.view(n, m, 256, -1).mean(-1).mean(1))


@torch.no_grad()
def full_test_scores(model, loader, n_total, device):
    """DistributedSampler(shuffle=False) gives rank r the padded positions r, r+W, r+2W, ...;
    interleaving the gathered shards restores dataset order, and the padded tail is cut off."""
    model.eval()
    local = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            local.append(model(x.to(device, non_blocking=True)).float())
    local = torch.cat(local)
    world = dist.get_world_size()
    gathered = torch.empty(world, *local.shape, device=device)
    dist.all_gather_into_tensor(gathered, local)
    return gathered.transpose(0, 1).reshape(-1, local.shape[-1])[:n_total]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/ntu120/xsub")
    ap.add_argument("--stream", default="bm", choices=list(STREAM_WEIGHTS))
    ap.add_argument("--ensemble-dir", default="work_dir/ntu120_xsub_ctrgcn")
    ap.add_argument("--epochs", type=int, default=65)
    ap.add_argument("--per-gpu", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--base-lr", type=float, default=0.1, help="for an effective batch of 64")
    ap.add_argument("--grad-ckpt", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.ensemble_dir, args.stream)

    train_set = StreamData(args.root, "train", args.stream, train=True)
    test_set = StreamData(args.root, "val", args.stream)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.per_gpu, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 128, sampler=test_sampler, num_workers=8, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(CTRGCN(120, grad_ckpt=args.grad_ckpt)).to(device)
    model = DDP(net, device_ids=[local_rank])
    eff_batch = args.per_gpu * world * args.accum
    lr = args.base_lr * eff_batch / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=4e-4)
    steps_per_epoch = len(train_loader) // args.accum
    warm = 5 * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.1 ** ((s >= 35 * steps_per_epoch) + (s >= 55 * steps_per_epoch)))
    scaler = torch.cuda.amp.GradScaler()
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(out_dir, "tb"))
        print(f"stream {args.stream}: {world} GPUs x {args.per_gpu} x accum {args.accum} = {eff_batch}, lr {lr:.4f}")

    labels = torch.as_tensor(test_set.y, device=device)
    best, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(train_loader):
            if it >= steps_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (it + 1) % args.accum == 0
            with (model.no_sync() if not sync_now else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y) / args.accum
                scaler.scale(loss).backward()
            loss_sum += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
            if sync_now:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                sched.step()
                step += 1
        dist.all_reduce(loss_sum)

        scores = full_test_scores(model, test_loader, len(test_set), device)
        p5 = scores.topk(5, 1).indices
        top1 = (p5[:, 0] == labels).float().mean().item()
        top5 = (p5 == labels[:, None]).any(1).float().mean().item()
        if rank == 0:
            mean_loss = (loss_sum[0] / loss_sum[1]).item()
            print(f"[{args.stream}] epoch {epoch + 1} loss {mean_loss:.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            writer.add_scalar("loss", mean_loss, epoch + 1)
            writer.add_scalar("top1", top1, epoch + 1)
            writer.add_scalar("lr", sched.get_last_lr()[0], epoch + 1)
            torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(out_dir, "last.pt"))
            if top1 > best:
                best = top1
                torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(out_dir, "best.pt"))
                with open(os.path.join(out_dir, "best_scores.pkl"), "wb") as f:
                    pickle.dump(scores.cpu().numpy(), f)

    if rank == 0:
        writer.close()
        fused, used = 0, []
        for s, w in STREAM_WEIGHTS.items():
            path = os.path.join(args.ensemble_dir, s, "best_scores.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    fused = fused + w * torch.from_numpy(pickle.load(f))
                used.append(s)
        if len(used) > 1:
            acc = (fused.argmax(1) == labels.cpu()).float().mean().item()
            print(f"ensemble {'+'.join(used)} top1 {acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
