"""
DVS128 Gesture, clip-level training and recording-level evaluation by voting.

Training draws one random 500 ms clip per recording; at test time every
recording is cut into consecutive 500 ms clips, each clip is classified and the
recording label is the majority vote over its clips.

    torchrun --nproc_per_node=4 09_gesture_clip_voting.py --root /data/DVS128Gesture
"""
import argparse
import os
import time
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def events_to_frames(ev, t_start, window_us, T, size=64):
    t = ev["t"]
    lo, hi = np.searchsorted(t, [t_start, t_start + window_us])
    x = ev["x"][lo:hi].astype(np.int64) // (128 // size)
    y = ev["y"][lo:hi].astype(np.int64) // (128 // size)
    p = ev["p"][lo:hi].astype(np.int64)
    b = ((t[lo:hi] - t_start) * T // window_us).astype(np.int64).clip(0, T - 1)
    frames = np.zeros((T, 2, size, size), dtype=np.float32)
    np.add.at(frames, (b, p, y, x), 1.0)
    return np.minimum(frames, 4.0) / 4.0


class GestureClips(Dataset):
    def __init__(self, base, recordings, window_us, T, train):
        self.base, self.window_us, self.T, self.train = base, window_us, T, train
        self.recordings = list(recordings)
        if train:
            self.index = [(r, None) for r in self.recordings]
        else:
            self.index = []
            for r in self.recordings:
                ev, _ = base[r]
                dur = int(ev["t"][-1] - ev["t"][0])
                for k in range(max(1, dur // window_us)):
                    self.index.append((r, int(ev["t"][0]) + k * window_us))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        r, start = self.index[i]
        ev, label = self.base[r]
        if start is None:
            t0, t1 = int(ev["t"][0]), int(ev["t"][-1])
            start = np.random.randint(t0, max(t0 + 1, t1 - self.window_us))
        frames = events_to_frames(ev, start, self.window_us, self.T)
        return torch.from_numpy(frames), label, r


def block(c_in, c_out):
    return [
        layer.SeqToANNContainer(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)),
        neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True),
        layer.SeqToANNContainer(nn.MaxPool2d(2)),
    ]


class ClipNet(nn.Module):
    def __init__(self, num_classes=11):
        super().__init__()
        self.net = nn.Sequential(
            *block(2, 64), *block(64, 128), *block(128, 128), *block(128, 256),
            layer.Flatten(),
            layer.SeqToANNContainer(nn.Dropout(0.3), nn.Linear(256 * 4 * 4, num_classes)),
        )
        functional.set_step_mode(self, "m")

    def forward(self, x):  # [B, T, 2, 64, 64]
        return self.net(x.transpose(0, 1)).mean(0)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    preds, recs, labels = [], [], []
    for x, y, r in loader:
        out = net(x.to(device, non_blocking=True))
        functional.reset_net(net)
        preds.append(out.argmax(1))
        recs.append(r.to(device))
        labels.append(y.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(recs), torch.cat(labels)])  # [3, n_clips]
    world = dist.get_world_size()
    bufs = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(bufs, local)
    allp = torch.cat(bufs, dim=1).cpu().numpy()

    clip_acc = float((allp[0] == allp[2]).mean())
    votes, truth = defaultdict(Counter), {}
    for p, r, y in allp.T:
        votes[r][p] += 1
        truth[r] = y
    rec_acc = float(np.mean([votes[r].most_common(1)[0][0] == truth[r] for r in votes]))
    return clip_acc, rec_acc, len(votes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=10)
    ap.add_argument("--window-ms", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="work_dirs/gesture_clips")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    window_us = args.window_ms * 1000

    if rank == 0:  # first call extracts the aedat files into per-sample .npz
        DVS128Gesture(args.root, train=True, data_type="event")
        DVS128Gesture(args.root, train=False, data_type="event")
    dist.barrier()
    base_train = DVS128Gesture(args.root, train=True, data_type="event")
    base_test = DVS128Gesture(args.root, train=False, data_type="event")

    train_set = GestureClips(base_train, range(len(base_train)), window_us, args.T, train=True)
    # whole recordings per rank, so that each recording's clips are voted on together
    test_set = GestureClips(base_test, range(rank, len(base_test), world), window_us, args.T, train=False)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True,
                              worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2**32))
    test_loader = DataLoader(test_set, batch_size=64, shuffle=False, num_workers=8, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ClipNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            functional.reset_net(model)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        clip_acc, rec_acc, n_rec = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"[{epoch:3d}] loss {run[0] / run[1]:.4f} clip acc {clip_acc:.4f} "
                  f"recording acc {rec_acc:.4f} ({n_rec} recordings) {time.time() - tic:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "latest.pth"))
            if rec_acc > best:
                best = rec_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
