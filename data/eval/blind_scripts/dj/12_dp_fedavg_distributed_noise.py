"""DP-FedAvg with the distributed Gaussian mechanism (user-level DP).

Every client (one per rank) clips its model update to L2 norm C and adds
N(0, (z*C)^2 / m) noise, so that the *sum* over the m clients carries exactly
N(0, (z*C)^2) noise -- the server never sees an update without noise once
secure aggregation is in place. Here secure aggregation is simulated by a
plain all_reduce.

    torchrun --nproc_per_node=8 12_dp_fedavg_distributed_noise.py --z 1.0 --clip 0.5
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class GaussianMechanism:
    """Clipping + Gaussian noise on flat update vectors."""

    def __init__(self, clip, noise_multiplier, n_contributors, seed=0, device="cuda:0"):
        self.clip = clip
        self.std = noise_multiplier * clip / math.sqrt(n_contributors)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)

    def clip_(self, vec):
        norm = vec.norm(2).item()
        if norm > self.clip:
            vec.mul_(self.clip / norm)
        return norm

    def add_noise_(self, vec):
        noise = torch.randn(vec.shape, generator=self.gen, device=self.device)
        vec.add_(noise, alpha=self.std)
        return vec


class MnistCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2, 1)
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


def dirichlet_split(targets, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    out = [[] for _ in range(n_clients)]
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(targets == c))
        w = rng.dirichlet(np.full(n_clients, alpha))
        for k, chunk in enumerate(np.split(idx, (np.cumsum(w)[:-1] * len(idx)).astype(int))):
            out[k] += chunk.tolist()
    return out


def local_sgd(model, loader, steps, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    it = iter(loader)
    losses = []
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return float(np.mean(losses))


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    right = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        right[0] += (model(x).argmax(1) == y).sum()
        right[1] += y.numel()
    dist.all_reduce(right)
    return (right[0] / right[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--logdir", default="./tb/dp_fedavg")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--local_steps", type=int, default=30)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--server_lr", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--z", type=float, default=1.0, help="noise multiplier")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    if rank == 0:
        datasets.MNIST(args.data, train=True, download=True)
        datasets.MNIST(args.data, train=False, download=True)
    dist.barrier()
    train = datasets.MNIST(args.data, train=True, transform=tf)
    test_set = datasets.MNIST(args.data, train=False, transform=tf)
    parts = dirichlet_split(train.targets.numpy(), world, args.alpha, args.seed)
    loader = DataLoader(Subset(train, parts[rank]), batch_size=args.batch_size, shuffle=True,
                        num_workers=2, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=1000)

    model = MnistCNN().to(device)
    global_w = parameters_to_vector(model.parameters()).detach()
    dist.broadcast(global_w, src=0)
    vector_to_parameters(global_w, model.parameters())

    # each client draws independent noise
    mech = GaussianMechanism(args.clip, args.z, n_contributors=world, seed=args.seed * 1000 + rank)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    for rnd in range(args.rounds):
        t0 = time.time()
        loss = local_sgd(model, loader, args.local_steps, args.lr, device)
        delta = parameters_to_vector(model.parameters()).detach() - global_w
        pre_clip = mech.clip_(delta)
        mech.add_noise_(delta)

        # uniform weighting keeps the sensitivity of the sum at C
        dist.all_reduce(delta)
        global_w = global_w + args.server_lr * delta / world
        vector_to_parameters(global_w, model.parameters())

        stats = torch.tensor([loss, pre_clip, float(pre_clip > args.clip)], device=device)
        dist.all_reduce(stats)
        stats /= world
        if (rnd + 1) % 10 == 0:
            acc = test(model, test_loader, device)
            if rank == 0:
                writer.add_scalar("test/acc", acc, rnd + 1)
                writer.add_scalar("train/loss", stats[0].item(), rnd + 1)
                writer.add_scalar("dp/mean_update_norm", stats[1].item(), rnd + 1)
                writer.add_scalar("dp/frac_clipped", stats[2].item(), rnd + 1)
                print(f"round {rnd + 1}: acc={acc:.4f} loss={stats[0].item():.4f} "
                      f"norm={stats[1].item():.3f} ({time.time() - t0:.2f}s)", flush=True)
                torch.save({"round": rnd + 1, "model": model.state_dict(),
                            "noise_multiplier": args.z, "clip": args.clip},
                           os.path.join(args.logdir, "dp_fedavg.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
