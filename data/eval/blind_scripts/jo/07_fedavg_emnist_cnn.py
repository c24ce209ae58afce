"""FedAvg on pre-partitioned EMNIST-ByClass client shards.

The partitioning job (prepare_fed_emnist.py) writes one file per client:
    <root>/client_0000.pt ... {"x": uint8[N,28,28], "y": int64[N]}
    <root>/test.pt
Clients are pinned to ranks (client c -> rank c % world), and every rank only
loads the shards of its own clients, which keeps host memory flat when we
simulate thousands of clients.

    torchrun --nproc_per_node=8 07_fedavg_emnist_cnn.py --root /data/fed_emnist_byclass --clients 3400
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/fed_emnist_byclass")
    ap.add_argument("--clients", type=int, default=3400)
    ap.add_argument("--per-round", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--bs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--save", default="checkpoints/emnist_fedavg.pt")
    ap.add_argument("--log-every", type=int, default=25)
    return ap.parse_args()


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.fc1 = nn.Linear(12 * 12 * 64, 128)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = self.conv(x).flatten(1)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def load_shard(path):
    blob = torch.load(path, map_location="cpu")
    x = blob["x"].float().div_(255.0).unsqueeze(1)
    x = (x - 0.1736) / 0.3317
    return TensorDataset(x, blob["y"].long())


def local_sgd(model, ds, epochs, bs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(ds, batch_size=bs, shuffle=True)
    last = 0.0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            last = loss.item()
    return last


@torch.no_grad()
def central_test(model, ds, rank, world, device):
    model.eval()
    idx = torch.arange(rank, len(ds), world)
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for chunk in idx.split(4096):
        x, y = ds.tensors[0][chunk].to(device), ds.tensors[1][chunk].to(device)
        correct += (model(x).argmax(1) == y).sum()
        total += len(chunk)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    t0 = time.time()
    my_ids = list(range(rank, args.clients, world))
    shards = {c: load_shard(os.path.join(args.root, f"client_{c:04d}.pt")) for c in my_ids}
    test_ds = load_shard(os.path.join(args.root, "test.pt"))
    num_classes = int(max(ds.tensors[1].max().item() for ds in shards.values())) + 1
    print(f"rank {rank}: {len(shards)} clients, {sum(len(d) for d in shards.values())} samples, "
          f"loaded in {time.time() - t0:.1f}s", flush=True)

    global_model = Net(num_classes).to(device)
    worker_model = Net(num_classes).to(device)
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)

    gen = torch.Generator().manual_seed(args.seed)
    for rnd in range(1, args.rounds + 1):
        chosen = torch.randperm(args.clients, generator=gen)[: args.per_round].tolist()
        local = [c for c in chosen if c % world == rank]

        sums = [torch.zeros_like(p) for p in global_model.parameters()]
        n_local = torch.zeros(1, device=device)
        losses = []
        for c in local:
            worker_model.load_state_dict(global_model.state_dict())
            losses.append(local_sgd(worker_model, shards[c], args.local_epochs, args.bs, args.lr, device))
            n = len(shards[c])
            for s, p in zip(sums, worker_model.parameters()):
                s.add_(p.detach(), alpha=n)
            n_local += n

        dist.all_reduce(n_local)
        with torch.no_grad():
            for s, p in zip(sums, global_model.parameters()):
                dist.all_reduce(s)
                p.copy_(s / n_local)

        if rnd % args.log_every == 0:
            acc = central_test(global_model, test_ds, rank, world, device)
            if rank == 0:
                mean_loss = sum(losses) / max(len(losses), 1)
                print(f"round {rnd:5d}  loss(r0) {mean_loss:.3f}  test_acc {acc:.4f}", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
        torch.save({"state_dict": global_model.state_dict(), "num_classes": num_classes}, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
