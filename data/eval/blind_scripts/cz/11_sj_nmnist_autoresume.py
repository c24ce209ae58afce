"""Spiking CNN on N-MNIST (spikingjelly), preemptible cluster version with auto-resume.

The job may be requeued at any time; it picks up from <out>/checkpoint.pth.

    torchrun --nproc_per_node=4 11_sj_nmnist_autoresume.py --root /data/NMNIST --out /ckpt/nmnist_sj
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.n_mnist import NMNIST
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


class CSNN(nn.Module):
    def __init__(self, T, channels=32, tau=2.0):
        super().__init__()
        self.T = T
        lif = lambda: neuron.LIFNode(tau=tau, surrogate_function=surrogate.Sigmoid(), detach_reset=True)
        self.conv_fc = nn.Sequential(
            layer.Conv2d(2, channels, 3, padding=1, bias=False),
            lif(),
            layer.MaxPool2d(2),  # 17
            layer.Conv2d(channels, channels * 2, 3, padding=1, bias=False),
            lif(),
            layer.MaxPool2d(2),  # 8
            layer.Flatten(),
            layer.Linear(channels * 2 * 8 * 8, 256, bias=False),
            lif(),
            layer.Linear(256, 10, bias=False),
            lif(),
        )
        functional.set_step_mode(self, step_mode="m")

    def forward(self, x):  # [N, T, 2, 34, 34]
        out = self.conv_fc(x.transpose(0, 1))
        return out.mean(0)  # firing rate per class


def spike_rate_hook(store):
    def hook(mod, inp, out):
        store.append(out.mean())
    return hook


def save_checkpoint(path, **state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--T", type=int, default=8)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--b", type=int, default=32, help="batch per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rate-reg", type=float, default=1e-3)
    p.add_argument("--j", type=int, default=4)
    args = p.parse_args()

    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    kw = dict(data_type="frame", frames_number=args.T, split_by="number")
    if rank == 0:
        NMNIST(args.root, train=True, **kw)
        NMNIST(args.root, train=False, **kw)
    dist.barrier()
    train_set = NMNIST(args.root, train=True, **kw)
    test_set = NMNIST(args.root, train=False, **kw)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.b, sampler=train_sampler,
                              num_workers=args.j, pin_memory=True, drop_last=True)
    # N-MNIST test has 10000 samples; shard it without padding
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=2 * args.b, num_workers=args.j, pin_memory=True)

    net = CSNN(args.T).to(device)
    rates = []
    for m in net.modules():
        if isinstance(m, neuron.LIFNode):
            m.register_forward_hook(spike_rate_hook(rates))
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch, max_test_acc = 0, -1.0
    if os.path.isfile(ckpt_path):
        checkpoint = torch.load(ckpt_path)
        model.module.load_state_dict(checkpoint["net"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        max_test_acc = checkpoint["max_test_acc"]
        if rank == 0:
            print(f"resumed from epoch {checkpoint['epoch']}, best {max_test_acc:.4f}", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        start_time = time.time()
        train_sampler.set_epoch(epoch)
        model.train()
        train = torch.zeros(3, device=device)
        for frame, label in train_loader:
            frame = frame.to(device, non_blocking=True).float()
            label = label.to(device, non_blocking=True)
            label_onehot = F.one_hot(label, 10).float()
            rates.clear()
            out_fr = model(frame)
            loss = F.mse_loss(out_fr, label_onehot) + args.rate_reg * torch.stack(rates).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            functional.reset_net(model)
            train += torch.stack([loss.detach() * label.numel(), (out_fr.argmax(1) == label).float().sum(),
                                  torch.tensor(float(label.numel()), device=device)])
        lr_scheduler.step()
        dist.all_reduce(train)

        model.eval()
        test = torch.zeros(2, device=device)
        with torch.no_grad():
            for frame, label in test_loader:
                frame, label = frame.to(device).float(), label.to(device)
                out_fr = model.module(frame)
                functional.reset_net(model.module)
                test += torch.stack([(out_fr.argmax(1) == label).float().sum(),
                                     torch.tensor(float(label.numel()), device=device)])
        rates.clear()
        dist.all_reduce(test)
        test_acc = (test[0] / test[1]).item()
        max_test_acc = max(max_test_acc, test_acc)

        stop_now = torch.tensor(float(STOP), device=device)
        dist.all_reduce(stop_now, op=dist.ReduceOp.MAX)
        if rank == 0:
            save_checkpoint(ckpt_path, net=model.module.state_dict(), optimizer=optimizer.state_dict(),
                            lr_scheduler=lr_scheduler.state_dict(), epoch=epoch, max_test_acc=max_test_acc)
            if test_acc >= max_test_acc:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_net.pth"))
            print(f"epoch {epoch} train_loss {train[0] / train[2]:.4f} train_acc {train[1] / train[2]:.4f} "
                  f"test_acc {test_acc:.4f} max {max_test_acc:.4f} {time.time() - start_time:.1f}s", flush=True)
        if stop_now.item() > 0:
            if rank == 0:
                print("SIGTERM received, checkpoint written, exiting for requeue", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
