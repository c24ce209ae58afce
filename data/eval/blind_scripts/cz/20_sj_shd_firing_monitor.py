"""SHD keyword spotting with a spikingjelly multi-step LIF MLP, plus per-layer firing-rate report.

    torchrun --nproc_per_node=4 20_sj_shd_firing_monitor.py --root /data/SHD --T 100
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, monitor, neuron, surrogate
from spikingjelly.datasets.shd import SpikingHeidelbergDigits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class SHDNet(nn.Module):
    def __init__(self, n_in=700, hidden=256, n_out=20, tau=10.0, p_drop=0.2):
        super().__init__()
        self.net = nn.Sequential(
            layer.Linear(n_in, hidden),
            neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.Dropout(p_drop),
            layer.Linear(hidden, hidden),
            neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.Dropout(p_drop),
            layer.Linear(hidden, n_out),
            # non-spiking readout: integrate, never fire
            neuron.LIFNode(tau=tau, v_threshold=float("inf"), surrogate_function=surrogate.ATan(),
                           store_v_seq=True),
        )
        functional.set_step_mode(self, "m")

    def forward(self, x):  # [B, T, 700]
        self.net(x.transpose(0, 1).contiguous())
        v_seq = self.net[-1].v_seq  # [T, B, 20]
        return v_seq.max(0).values


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 256")
    ap.add_argument("--out", default="runs/shd_sj")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    kw = dict(data_type="frame", frames_number=args.T, split_by="number")
    if rank == 0:  # integrates the h5 spikes into frames on first use
        SpikingHeidelbergDigits(args.root, train=True, **kw)
        SpikingHeidelbergDigits(args.root, train=False, **kw)
    dist.barrier()
    train_set = SpikingHeidelbergDigits(args.root, train=True, **kw)
    test_set = SpikingHeidelbergDigits(args.root, train=False, **kw)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 256,
                             num_workers=4, pin_memory=True)

    net = SHDNet().to(device)
    spike_mon = monitor.OutputMonitor(net, neuron.LIFNode, lambda y: y.detach().mean().item())
    spike_mon.disable()
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    history, best = [], 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True).float(), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            functional.reset_net(model)
            tr += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                               torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(tr)

        # evaluation, with the firing-rate monitor switched on
        net.eval()
        spike_mon.clear_recorded_data()
        spike_mon.enable()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                logits = net(x.to(device).float())
                functional.reset_net(net)
                te += torch.stack([(logits.argmax(1) == y.to(device)).sum().float(),
                                   torch.tensor(float(len(y)), device=device)])
        spike_mon.disable()
        dist.all_reduce(te)
        test_acc = (te[0] / te[1]).item()

        # mean firing rate of each hidden LIF layer over this rank's test batches, averaged over ranks
        n_layers = len(spike_mon.monitored_layers) - 1  # last one is the readout
        rates = torch.tensor([
            sum(spike_mon[name]) / max(len(spike_mon[name]), 1) for name in spike_mon.monitored_layers[:n_layers]
        ])
        dist.all_reduce(rates)
        rates /= world

        if rank == 0:
            row = {"epoch": epoch, "loss": (tr[0] / tr[2]).item(), "train_acc": (tr[1] / tr[2]).item(),
                   "test_acc": test_acc, "rates": [round(r, 4) for r in rates.tolist()],
                   "time": round(time.time() - t0, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if test_acc > best:
                best = test_acc
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))

    spike_mon.remove_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
