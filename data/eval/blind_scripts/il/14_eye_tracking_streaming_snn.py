"""Event-based pupil tracking (3ET+ style data) with a streaming spiking ConvNet.

Recordings are played back as continuous streams: the membrane state is
carried from one chunk to the next (truncated BPTT, detached at chunk
boundaries) and only reset when a stream moves on to a new recording.

Prepared data (tools/prep_3et.py): <root>/{train,val}/<rec>/frames.npy [N, 2, 60, 80] uint8
(10 ms event histograms) and label.npy [N, 3] (x, y in pixels at 640x480, closed flag).

    torchrun --nproc_per_node=4 14_eye_tracking_streaming_snn.py --root /data/3et_prep
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

SCALE = torch.tensor([640.0, 480.0])


def load_recording(path):
    frames = np.load(os.path.join(path, "frames.npy"), mmap_mode="r")
    label = np.load(os.path.join(path, "label.npy"))
    return frames, label


class StreamBatcher:
    """Plays a list of recordings back as `n_streams` parallel streams in chunks of `chunk` frames."""

    def __init__(self, recordings, n_streams, chunk, shuffle, seed=0):
        self.recordings, self.n_streams, self.chunk = recordings, n_streams, chunk
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        recs = list(self.recordings)
        if self.shuffle:
            np.random.RandomState(self.seed + self.epoch).shuffle(recs)
        queues = [recs[i::self.n_streams] for i in range(self.n_streams)]
        cur = [None] * self.n_streams  # (frames, labels, pos)
        while True:
            xs, ys, valid, reset = [], [], [], []
            for s in range(self.n_streams):
                r = False
                if cur[s] is None or cur[s][2] >= len(cur[s][0]):
                    if queues[s]:
                        f, l = load_recording(queues[s].pop(0))
                        cur[s], r = (f, l, 0), True
                    else:
                        cur[s] = None
                if cur[s] is None:
                    xs.append(np.zeros((self.chunk, 2, 60, 80), np.float32))
                    ys.append(np.zeros((self.chunk, 3), np.float32))
                    valid.append(np.zeros(self.chunk, np.float32))
                    reset.append(True)
                    continue
                f, l, pos = cur[s]
                n = min(self.chunk, len(f) - pos)
                x = np.zeros((self.chunk, 2, 60, 80), np.float32)
                y = np.zeros((self.chunk, 3), np.float32)
                x[:n], y[:n] = f[pos:pos + n], l[pos:pos + n]
                m = np.zeros(self.chunk, np.float32)
                m[:n] = 1.0
                xs.append(x), ys.append(y), valid.append(m), reset.append(r)
                cur[s] = (f, l, pos + n)
            if all(c is None for c in cur):
                return
            yield (torch.from_numpy(np.stack(xs, 1)), torch.from_numpy(np.stack(ys, 1)),
                   torch.from_numpy(np.stack(valid, 1)), torch.tensor(reset))


class Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).float()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 0.3 * F.relu(1.0 - x.abs())  # triangle surrogate


class EyeSNN(nn.Module):
    def __init__(self, beta=0.8):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(2, 16, 3, 2, 1), nn.Conv2d(16, 32, 3, 2, 1),
                                    nn.Conv2d(32, 64, 3, 2, 1), nn.Conv2d(64, 128, 3, 2, 1)])
        self.norms = nn.ModuleList([nn.GroupNorm(4, c) for c in (16, 32, 64, 128)])
        self.fc = nn.Linear(128 * 4 * 5, 128)
        self.out = nn.Linear(128, 3)  # x, y, closed-logit
        self.beta = beta

    def init_state(self, B, device):
        shapes = [(16, 30, 40), (32, 15, 20), (64, 8, 10), (128, 4, 5), (128,)]
        return [torch.zeros(B, *s, device=device) for s in shapes]

    def forward(self, x, state):
        # x [T, B, 2, 60, 80]; state: list of membranes, carried over between chunks
        outs = []
        for t in range(x.size(0)):
            h = x[t]
            new_state = []
            for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
                v = self.beta * state[i] + norm(conv(h))
                h = Spike.apply(v - 1.0)
                new_state.append(v - h)
            v = self.beta * state[-1] + self.fc(h.flatten(1))
            h = Spike.apply(v - 1.0)
            new_state.append(v - h)
            state = new_state
            outs.append(self.out(state[-1]))
        return torch.stack(outs), state


def loss_fn(pred, target, valid):
    xy = (target[..., :2] / SCALE.to(target.device))
    l_xy = (F.smooth_l1_loss(torch.sigmoid(pred[..., :2]), xy, reduction="none").sum(-1) * valid).sum()
    l_cls = (F.binary_cross_entropy_with_logits(pred[..., 2], target[..., 2], reduction="none") * valid).sum()
    return (l_xy + 0.1 * l_cls) / valid.sum().clamp(min=1)


@torch.no_grad()
def evaluate(net, batcher, device):
    net.eval()
    st = torch.zeros(3, device=device)  # hits@10px, sum dist, n
    state = None
    for x, y, valid, reset in batcher:
        x, y, valid = x.to(device), y.to(device), valid.to(device)
        if state is None:
            state = net.init_state(x.size(1), device)
        keep = (~reset).to(device).float()
        state = [s * keep.view(-1, *[1] * (s.dim() - 1)) for s in state]
        pred, state = net(x, state)
        xy = torch.sigmoid(pred[..., :2]) * SCALE.to(device)
        dist_px = torch.norm(xy - y[..., :2], dim=-1)
        m = (valid > 0) & (y[..., 2] < 0.5)  # open-eye frames only
        st += torch.stack([(dist_px[m] < 10).float().sum(), dist_px[m].sum(), m.sum().float()])
    return st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/eye_snn")
    ap.add_argument("--streams", type=int, default=16, help="parallel streams per GPU")
    ap.add_argument("--chunk", type=int, default=40, help="frames per TBPTT chunk")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_recs = sorted(os.path.join(args.root, "train", r) for r in os.listdir(os.path.join(args.root, "train")))
    val_recs = sorted(os.path.join(args.root, "val", r) for r in os.listdir(os.path.join(args.root, "val")))
    # every rank streams its own share of the recordings
    train_batcher = StreamBatcher(train_recs[rank::world], args.streams, args.chunk, shuffle=True)
    val_batcher = StreamBatcher(val_recs[rank::world], args.streams, args.chunk, shuffle=False)

    net = EyeSNN().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_batcher.set_epoch(epoch)
        model.train()
        tic, n_steps, loss_sum = time.time(), 0, torch.zeros((), device=device)
        state = net.init_state(args.streams, device)
        for x, y, valid, reset in train_batcher:
            x = x.to(device, non_blocking=True)
            y, valid = y.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            keep = (~reset).to(device).float()
            # detach (truncated BPTT) and zero the streams that started a new recording
            state = [s.detach() * keep.view(-1, *[1] * (s.dim() - 1)) for s in state]
            pred, state = model(x, state)
            loss = loss_fn(pred, y, valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            n_steps += 1
        scheduler.step()

        st = evaluate(net, val_batcher, device)
        dist.all_reduce(st)
        p10, mean_px = (st[0] / st[2]).item(), (st[1] / st[2]).item()
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss_sum.item() / max(n_steps, 1):.4f} (rank 0, {n_steps} chunks) | "
                  f"val p10 {p10:.4f} mean err {mean_px:.2f}px | {time.time() - tic:.0f}s", flush=True)
            ckpt = {"model": net.state_dict(), "epoch": epoch, "p10": p10}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if p10 > best:
                best = p10
                torch.save(ckpt, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
