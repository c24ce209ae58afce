"""DistMult, multi-node under Slurm (srun starts one task per GPU).

sbatch snippet:
    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    srun python 17_distmult_slurm_accum.py --data /shared/kg/fb15k237 --out /shared/runs/dm

The learning rate is given for a reference global batch of 1024 triples and is
scaled linearly with the actual global batch (micro_bs * accum * world_size).
"""
import argparse
import os
import subprocess
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def slurm_setup():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).decode().split()
        os.environ["MASTER_ADDR"] = nodes[0]
    # job-specific port so two jobs sharing a node do not collide
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    # with --gpus-per-task=1 each task sees a single device
    device_index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device_index)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, torch.device("cuda", device_index)


def parse_kg(root):
    ents, rels, raw = set(), set(), {}
    for s in ("train", "valid", "test"):
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(root, f"{s}.txt"))]
        raw[s] = rows
        for h, r, t in rows:
            ents.update((h, t))
            rels.add(r)
    e2i = {e: i for i, e in enumerate(sorted(ents))}
    r2i = {r: i for i, r in enumerate(sorted(rels))}
    data = {s: torch.tensor([[e2i[h], r2i[r], e2i[t]] for h, r, t in rows]) for s, rows in raw.items()}
    data["n_ent"], data["n_rel"] = len(e2i), len(r2i)
    return data


def load_cached(root, out, rank):
    cache = os.path.join(out, "kg_cache.pt")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(out, exist_ok=True)
        data = parse_kg(root)
        torch.save(data, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    return torch.load(cache)


class DistMult(nn.Module):
    def __init__(self, n_ent, n_rel, dim, drop=0.2):
        super().__init__()
        self.E = nn.Embedding(n_ent, dim)
        self.R = nn.Embedding(n_rel, dim)
        self.drop = nn.Dropout(drop)
        nn.init.xavier_normal_(self.E.weight)
        nn.init.xavier_normal_(self.R.weight)

    def forward(self, hr):
        q = self.drop(self.E(hr[:, 0]) * self.R(hr[:, 1]))
        return q @ self.E.weight.t()


@torch.no_grad()
def evaluate(model, trip, filt, device, rank, world, bs=512):
    model.eval()
    part = trip[rank::world]
    s = torch.zeros(4, dtype=torch.float64, device=device)
    for i in range(0, part.size(0), bs):
        b = part[i:i + bs].to(device)
        sc = model(b[:, :2])
        g = sc.gather(1, b[:, 2:3]).clone()
        for j, (h, r, _) in enumerate(b.tolist()):
            sc[j, filt[(h, r)]] = -float("inf")
        sc.scatter_(1, b[:, 2:3], g)
        rk = (sc > g).sum(1).double() + 1
        s[0] += (1 / rk).sum()
        s[1] += (rk <= 3).sum()
        s[2] += (rk <= 10).sum()
        s[3] += rk.numel()
    dist.all_reduce(s)
    model.train()
    return {"mrr": (s[0] / s[3]).item(), "h@3": (s[1] / s[3]).item(), "h@10": (s[2] / s[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--dim", type=int, default=400)
    ap.add_argument("--micro_bs", type=int, default=128)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base_lr", type=float, default=1e-3, help="lr at global batch 1024")
    ap.add_argument("--warmup_steps", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=10)
    args = ap.parse_args()

    rank, world, device = slurm_setup()
    data = load_cached(args.data, args.out, rank)
    n_ent, n_rel = data["n_ent"], data["n_rel"]
    recip = lambda x: torch.cat([x, torch.stack([x[:, 2], x[:, 1] + n_rel, x[:, 0]], 1)])
    train, valid, test = recip(data["train"]), recip(data["valid"]), recip(data["test"])
    filt = defaultdict(list)
    for h, r, t in torch.cat([train, valid, test]).tolist():
        filt[(h, r)].append(t)

    ds = TensorDataset(train)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, drop_last=True,
                        num_workers=int(os.environ.get("SLURM_CPUS_PER_TASK", 4)) - 1,
                        pin_memory=True)

    global_bs = args.micro_bs * args.accum * world
    lr = args.base_lr * global_bs / 1024
    steps_per_epoch = len(loader) // args.accum
    total_steps = steps_per_epoch * args.epochs
    if rank == 0:
        print(f"world {world}, global batch {global_bs}, lr {lr:.2e}, {total_steps} steps", flush=True)

    model = DistMult(n_ent, 2 * n_rel, args.dim).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)

    def warmup_linear(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - args.warmup_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear)

    best, ckpt_path = -1.0, os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for i, (x,) in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break
            x = x.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            y = F.one_hot(x[:, 2], n_ent).float() * 0.9 + 0.1 / n_ent
            if last_micro:
                loss = F.binary_cross_entropy_with_logits(ddp(x[:, :2]), y) / args.accum
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            else:
                with ddp.no_sync():
                    loss = F.binary_cross_entropy_with_logits(ddp(x[:, :2]), y) / args.accum
                    loss.backward()
            loss_acc += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
        dist.all_reduce(loss_acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.5f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(model, valid, filt, device, rank, world)
            if rank == 0:
                print(f"  valid {m}", flush=True)
                if m["mrr"] > best:
                    best = m["mrr"]
                    torch.save({"model": model.state_dict(), "epoch": epoch}, ckpt_path)
            dist.barrier()

    model.load_state_dict(torch.load(ckpt_path, map_location=device)["model"])
    m = evaluate(model, test, filt, device, rank, world)
    if rank == 0:
        print(f"test {m}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
