"""FedProx on EMNIST-balanced with client-level (local) differential privacy.

One process per client. Each client clips its model update to L2 norm `clip`
and adds Gaussian noise before the update leaves the client; the server step
is a sample-weighted all_reduce of the noisy updates.

Launch:
    torchrun --standalone --nproc_per_node=4 02_fedprox_emnist_ldp.py --mu 0.01
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
import torchvision
import torchvision.transforms as T
import wandb
from torch.utils.data import DataLoader, Subset


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/datasets/emnist")
    ap.add_argument("--ckpt-dir", default="checkpoints/fedprox_emnist")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--local-steps", type=int, default=50)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--mu", type=float, default=0.01, help="proximal term weight")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--noise-multiplier", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb-project", default="fl-emnist")
    return ap.parse_args()


def partition_dirichlet(targets, n_clients, alpha, rng):
    n_classes = int(targets.max()) + 1
    buckets = [[] for _ in range(n_clients)]
    for c in range(n_classes):
        idx = rng.permutation(np.flatnonzero(targets == c))
        p = rng.dirichlet(alpha * np.ones(n_clients))
        bounds = np.round(np.cumsum(p) * len(idx)).astype(int)[:-1]
        for client, chunk in enumerate(np.split(idx, bounds)):
            buckets[client] += chunk.tolist()
    return [np.array(sorted(b)) for b in buckets]


class Net(nn.Module):
    def __init__(self, n_out=47):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout(0.25),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                                  nn.Dropout(0.5), nn.Linear(128, n_out))

    def forward(self, x):
        return self.head(self.features(x))


def infinite(loader):
    while True:
        for batch in loader:
            yield batch


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_flat_(model, flat):
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.data.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def client_update(model, batches, args, device):
    global_params = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    running = 0.0
    for _ in range(args.local_steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), global_params))
        (loss + 0.5 * args.mu * prox).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
    return running / args.local_steps


def privatize(delta, clip, sigma, gen):
    norm = delta.norm(2)
    delta = delta * min(1.0, clip / (norm.item() + 1e-12))
    noise = torch.randn(delta.shape, generator=gen, device=delta.device) * sigma * clip
    return delta + noise, norm.item()


@torch.no_grad()
def evaluate_global(model, test_set, device):
    # every rank scores a strided slice of the test set, counts are summed
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = Subset(test_set, list(range(rank, len(test_set), world)))
    loader = DataLoader(shard, batch_size=1024, num_workers=2)
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(-1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    # local randomness (shuffling, dropout) is per client on purpose; the
    # partition uses its own generator seeded identically on every rank
    torch.manual_seed(args.seed + 1000 * rank)
    part_rng = np.random.default_rng(args.seed)

    tf = T.Compose([T.ToTensor(), T.Normalize((0.1751,), (0.3332,))])
    train = torchvision.datasets.EMNIST(args.data_root, split="balanced", train=True, transform=tf)
    test = torchvision.datasets.EMNIST(args.data_root, split="balanced", train=False, transform=tf)
    parts = partition_dirichlet(train.targets.numpy(), world, args.alpha, part_rng)
    my_idx = parts[rank]
    n_local = len(my_idx)
    loader = DataLoader(Subset(train, my_idx.tolist()), batch_size=args.bs, shuffle=True,
                        num_workers=4, pin_memory=True, drop_last=len(my_idx) > args.bs)
    batches = infinite(loader)

    model = Net().to(device)
    start_round = 0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        start_round = ckpt["round"] + 1
    else:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    run = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        run = wandb.init(project=args.wandb_project, config=vars(args),
                         name=f"fedprox-mu{args.mu}-a{args.alpha}", resume="allow")

    noise_gen = torch.Generator(device=device)
    n_total = torch.tensor([float(n_local)], device=device)
    dist.all_reduce(n_total)
    weight = n_local / n_total.item()

    for rnd in range(start_round, args.rounds):
        tic = time.time()
        noise_gen.manual_seed(args.seed * 7919 + rnd * world + rank)
        w_global = flat_params(model)
        train_loss = client_update(model, batches, args, device)
        delta = flat_params(model) - w_global
        noisy_delta, raw_norm = privatize(delta, args.clip, args.noise_multiplier, noise_gen)

        noisy_delta.mul_(weight)
        dist.all_reduce(noisy_delta)
        load_flat_(model, w_global + noisy_delta)

        stats = torch.tensor([train_loss * n_local, raw_norm, float(raw_norm > args.clip)],
                             device=device)
        dist.all_reduce(stats)
        if rnd % 10 == 0 or rnd == args.rounds - 1:
            test_loss, test_acc = evaluate_global(model, test, device)
            if rank == 0:
                run.log({"round": rnd,
                         "train/loss": stats[0].item() / n_total.item(),
                         "train/mean_update_norm": stats[1].item() / world,
                         "train/frac_clipped": stats[2].item() / world,
                         "test/loss": test_loss, "test/acc": test_acc,
                         "round_time": time.time() - tic}, step=rnd)
                torch.save({"round": rnd, "model": model.state_dict(), "args": vars(args)},
                           ckpt_path)
            dist.barrier()

    if rank == 0:
        run.summary["client_noise_std"] = args.noise_multiplier * args.clip
        run.summary["uniform_weight_noise_std"] = args.noise_multiplier * args.clip / math.sqrt(world)
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
