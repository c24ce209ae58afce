"""N-MNIST with a fully-connected snntorch network of second-order (Synaptic) neurons.

Tracks accuracy, loss and per-layer firing rates in Weights & Biases.

    torchrun --nproc_per_node=4 19_snntorch_synaptic_wandb.py --data ./data --wandb-project snn-nmnist
"""
import argparse
import os
import time

import numpy as np
import snntorch as snn
import snntorch.functional as SF
import tonic
import tonic.transforms as transforms
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from snntorch import surrogate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class SynapticMLP(nn.Module):
    def __init__(self, n_in=2 * 34 * 34, hidden=(800, 400), n_out=10, alpha=0.8, beta=0.9):
        super().__init__()
        sg = surrogate.sigmoid(slope=10)
        sizes = (n_in,) + tuple(hidden)
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.syns = nn.ModuleList(snn.Synaptic(alpha=alpha, beta=beta, spike_grad=sg) for _ in hidden)
        self.fc_out = nn.Linear(sizes[-1], n_out)
        self.syn_out = snn.Synaptic(alpha=alpha, beta=beta, spike_grad=sg)

    def forward(self, x):  # [T, B, 2, 34, 34]
        states = [layer.init_synaptic() for layer in self.syns]
        out_syn, out_mem = self.syn_out.init_synaptic()
        spk_rec, counts = [], [0.0] * len(self.syns)
        for t in range(x.shape[0]):
            h = x[t].flatten(1)
            for k, (fc, layer) in enumerate(zip(self.fcs, self.syns)):
                syn, mem = states[k]
                h, syn, mem = layer(fc(h), syn, mem)
                states[k] = (syn, mem)
                counts[k] = counts[k] + h.mean()
            spk, out_syn, out_mem = self.syn_out(self.fc_out(h), out_syn, out_mem)
            spk_rec.append(spk)
        return torch.stack(spk_rec), torch.stack(counts) / x.shape[0]


def collate_frames(batch):
    frames = torch.stack([torch.as_tensor(np.minimum(f, 1), dtype=torch.float32) for f, _ in batch], dim=1)
    return frames, torch.tensor([t for _, t in batch])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./checkpoints/synaptic_mlp")
    ap.add_argument("--wandb-project", default="snn-nmnist")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--n-bins", type=int, default=25)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4, help="for global batch 256")
    ap.add_argument("--rate-reg", type=float, default=0.05)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name,
               config={**vars(args), "world_size": world_size, "global_batch": args.batch_size * world_size})

    tf = transforms.ToFrame(sensor_size=tonic.datasets.NMNIST.sensor_size, n_time_bins=args.n_bins)
    if rank == 0:
        tonic.datasets.NMNIST(save_to=args.data, train=True)
        tonic.datasets.NMNIST(save_to=args.data, train=False)
    dist.barrier()
    train_set = tonic.datasets.NMNIST(save_to=args.data, train=True, transform=tf)
    test_set = tonic.datasets.NMNIST(save_to=args.data, train=False, transform=tf)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              collate_fn=collate_frames, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256,
                             num_workers=6, collate_fn=collate_frames, pin_memory=True)

    model = SynapticMLP().to(device)
    # membrane/synaptic state buffers are per-rank scratch, nothing to broadcast (no BatchNorm)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loss_fn = SF.ce_count_loss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            spk, rates = model(x)
            loss = loss_fn(spk, y) + args.rate_reg * rates.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if i % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/rate_l1": rates[0].item(),
                           "train/rate_l2": rates[1].item(), "lr": scheduler.get_last_lr()[0]},
                          step=global_step)
        scheduler.step()

        net = model.module.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                spk, _ = net(x.to(device))
                c[0] += (spk.sum(0).argmax(1).cpu() == y).sum().item()
                c[1] += y.numel()
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        wandb.log({"test/acc": acc, "epoch": epoch, "epoch_time": time.time() - tic}, step=global_step)

        if rank == 0:
            print(f"epoch {epoch}: test acc {acc:.4f} ({int(c[1])} samples)", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
