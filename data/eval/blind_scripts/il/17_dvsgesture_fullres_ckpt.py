"""Full-resolution (128x128) spiking VGG on DVS128 Gesture with long time windows.

T=60 frames at full resolution does not fit in memory with plain BPTT, so the
network step is checkpointed per time step and recomputed during backward.

    torchrun --nproc_per_node=4 17_dvsgesture_fullres_ckpt.py --data /datasets/dvsgesture --T 60
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tonic
import tonic.transforms as tt
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class FastSigmoidSpike(torch.autograd.Function):
    scale = 10.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / (FastSigmoidSpike.scale * x.abs() + 1.0) ** 2


spike = FastSigmoidSpike.apply


class SpikingVGG(nn.Module):
    CHANNELS = (64, 128, 128, 256, 256)

    def __init__(self, num_classes=11, beta=0.9):
        super().__init__()
        convs, norms, cin = [], [], 2
        for c in self.CHANNELS:
            convs.append(nn.Conv2d(cin, c, 3, padding=1, bias=False))
            norms.append(nn.GroupNorm(8, c))
            cin = c
        self.convs, self.norms = nn.ModuleList(convs), nn.ModuleList(norms)
        self.fc1 = nn.Linear(256 * 4 * 4, 256)
        self.fc2 = nn.Linear(256, num_classes)
        self.beta = beta

    def init_state(self, x):
        B, _, H, W = x.shape
        state = []
        for i, c in enumerate(self.CHANNELS):
            state.append(x.new_zeros(B, c, H >> i, W >> i))
        state.append(x.new_zeros(B, 256))
        state.append(x.new_zeros(B, self.fc2.out_features))
        return state

    def step(self, x, *state):
        new, h = [], x
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            v = self.beta * state[i] + norm(conv(h))
            s = spike(v - 1.0)
            new.append(v - s)  # subtractive reset
            h = F.max_pool2d(s, 2)
        v = self.beta * state[-2] + self.fc1(h.flatten(1))
        s = spike(v - 1.0)
        new.append(v - s)
        v_out = self.beta * state[-1] + self.fc2(s)  # leaky integrator readout, no reset
        new.append(v_out)
        return tuple(new)

    def forward(self, x_seq, ckpt=True):
        # x_seq [B, T, 2, H, W]
        state = self.init_state(x_seq[:, 0])
        outs = []
        for t in range(x_seq.size(1)):
            x_t = x_seq[:, t]
            if ckpt and self.training:
                # checkpoint only tracks gradients if an input requires grad
                x_t = x_t.detach().requires_grad_(True)
                state = checkpoint(self.step, x_t, *state)
            else:
                state = self.step(x_t, *state)
            outs.append(state[-1])
        return torch.stack(outs, 1).mean(1)


def make_datasets(root, T):
    sensor = tonic.datasets.DVSGesture.sensor_size
    tf = tt.Compose([tt.Denoise(filter_time=10000), tt.ToFrame(sensor_size=sensor, n_time_bins=T)])
    train = tonic.datasets.DVSGesture(save_to=root, train=True, transform=tf)
    test = tonic.datasets.DVSGesture(save_to=root, train=False, transform=tf)
    return train, test


def collate(batch):
    x = torch.stack([torch.from_numpy(np.asarray(f, dtype=np.float32)) for f, _ in batch])
    return (x > 0).float(), torch.as_tensor([y for _, y in batch])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--logdir", default="runs/gesture_fullres")
    ap.add_argument("--T", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        make_datasets(args.data, args.T)
    dist.barrier()
    train_set, test_set = make_datasets(args.data, args.T)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, collate_fn=collate, num_workers=args.workers)

    net = SpikingVGG().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tr = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tr += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                               torch.tensor(float(y.numel()), device=device)])
        scheduler.step()

        net.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                te += torch.stack([(net(x, ckpt=False).argmax(1) == y).sum().float(),
                                   torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(te)

        if rank == 0:
            acc = (te[0] / te[1]).item()
            writer.add_scalar("train/loss", (tr[0] / tr[2]).item(), epoch)
            writer.add_scalar("train/acc", (tr[1] / tr[2]).item(), epoch)
            writer.add_scalar("test/acc", acc, epoch)
            print(f"epoch {epoch} loss {(tr[0] / tr[2]).item():.4f} test acc {acc:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.logdir, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"model": net.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.logdir, "best.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
