"""FedAvg on LEAF CelebA (one client per celebrity), "Smiling" attribute.

Clients join each round by independent Bernoulli(q) sampling (Poisson sampling, as
used for user-level DP accounting), so the number of participants varies per round.
Participants are spread over the ranks by client id.

    torchrun --nproc_per_node=8 20_fedavg_celeba_attr.py --leaf /data/leaf/celeba --q 0.002
"""
import argparse
import glob
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

log = logging.getLogger("celeba")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--leaf", default="/data/leaf/celeba")
    p.add_argument("--out", default="/shared/exp/celeba_fedavg")
    p.add_argument("--q", type=float, default=0.002, help="per-client participation probability")
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--eval-every", type=int, default=100)
    return p.parse_args()


class FaceSet(Dataset):
    def __init__(self, img_dir, files, labels, tf):
        self.img_dir, self.files, self.labels, self.tf = img_dir, files, labels, tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.files[i])).convert("RGB")
        return self.tf(img), int(self.labels[i])


class CelebaCNN(nn.Module):
    """LEAF reference model (4 x conv 3x3 / norm / maxpool / ReLU + linear), GroupNorm instead of BN."""

    def __init__(self):
        super().__init__()
        blocks, c = [], 3
        for _ in range(4):
            blocks += [nn.Conv2d(c, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.MaxPool2d(2), nn.ReLU()]
            c = 32
        self.features = nn.Sequential(*blocks)
        self.fc = nn.Linear(32 * 5 * 5, 2)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def read_split(path):
    users, data = [], {}
    for fn in sorted(glob.glob(os.path.join(path, "*.json"))):
        with open(fn) as f:
            d = json.load(f)
        users += d["users"]
        data.update(d["user_data"])
    return users, data


def local_steps(model, loader, steps, lr, clip, dev):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    done = 0
    while done < steps:
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            done += 1
            if done == steps:
                break


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s")
    torch.manual_seed(args.seed + rank)

    tf = transforms.Compose([transforms.Resize((84, 84)), transforms.ToTensor(),
                             transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    img_dir = os.path.join(args.leaf, "data", "raw", "img_align_celeba")
    users, train = read_split(os.path.join(args.leaf, "data", "train"))
    _, test = read_split(os.path.join(args.leaf, "data", "test"))
    if rank == 0:
        log.info("%d clients, expected %.1f per round", len(users), args.q * len(users))

    model = CelebaCNN().to(dev)
    local = CelebaCNN().to(dev)
    for t in model.state_dict().values():
        dist.broadcast(t, 0)

    for rnd in range(args.rounds):
        t0 = time.time()
        rng = np.random.default_rng([args.seed, rnd])
        participants = np.flatnonzero(rng.random(len(users)) < args.q)
        mine = [c for c in participants if c % world == rank]
        if not mine:
            log.debug("round %d: no participant on this rank", rnd)
            continue

        sums = [torch.zeros_like(p) for p in model.parameters()]
        cnt = torch.zeros(1, device=dev)
        for c in mine:
            u = users[c]
            ds = FaceSet(img_dir, train[u]["x"], train[u]["y"], tf)
            loader = DataLoader(ds, batch_size=args.bs, shuffle=True, num_workers=2)
            local.load_state_dict(model.state_dict())
            local_steps(local, loader, args.local_steps, args.lr, args.clip, dev)
            for s, p in zip(sums, local.parameters()):
                s.add_(p.detach(), alpha=len(ds))
            cnt += len(ds)

        dist.all_reduce(cnt)
        for s in sums:
            dist.all_reduce(s)
        with torch.no_grad():
            for p, s in zip(model.parameters(), sums):
                p.copy_(s / cnt)
        if rank == 0 and rnd % 50 == 0:
            log.info("round %d: %d participants, %.1fs", rnd, len(participants), time.time() - t0)

        if (rnd + 1) % args.eval_every == 0:
            model.eval()
            st = torch.zeros(2, device=dev)
            with torch.no_grad():
                for u in users[rank::world]:
                    ds = FaceSet(img_dir, test[u]["x"], test[u]["y"], tf)
                    if len(ds) == 0:
                        continue
                    for x, y in DataLoader(ds, batch_size=64):
                        x, y = x.to(dev), y.to(dev)
                        st[0] += (model(x).argmax(1) == y).sum()
                        st[1] += len(y)
            dist.all_reduce(st)
            if rank == 0:
                log.info("round %d: test acc %.4f", rnd + 1, (st[0] / st[1]).item())
                os.makedirs(args.out, exist_ok=True)
                torch.save({"round": rnd + 1, "model": model.state_dict()},
                           os.path.join(args.out, "global.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
