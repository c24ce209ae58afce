"""DimeNet++ on QM9 (single target, default U0 in eV) with PyTorch Geometric + DDP.

    torchrun --nproc_per_node=4 12_qm9_dimenet_u0.py --target 7 --epochs 800
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import random_split
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import DimeNetPlusPlus
from torch.utils.tensorboard import SummaryWriter

HAR2EV = 27.211386246
TARGET_NAMES = ["mu", "alpha", "homo", "lumo", "gap", "r2", "zpve", "U0", "U", "H", "G", "Cv"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/QM9")
    p.add_argument("--target", type=int, default=7)
    p.add_argument("--n-train", type=int, default=110000)
    p.add_argument("--n-val", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=3000)
    p.add_argument("--decay-steps", type=int, default=4_000_000)
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--logdir", default="runs/dimenetpp_qm9")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class SelectTarget:
    def __init__(self, t):
        self.t = t

    def __call__(self, data):
        data.y = data.y[:, self.t]
        return data


@torch.no_grad()
def evaluate(model, loader, device, mean, std):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device, non_blocking=True)
        pred = model(data.z, data.pos, data.batch).view(-1)
        acc[0] += (pred * std + mean - data.y).abs().sum()
        acc[1] += data.num_graphs
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # per-rank RNG streams; DDP broadcasts rank 0's initial weights at construction
    seed_everything(args.seed + rank)

    # let rank 0 download + process QM9 once, the others read the processed files
    if rank == 0:
        QM9(args.root)
    dist.barrier()
    dataset = QM9(args.root, transform=SelectTarget(args.target))

    n_test = len(dataset) - args.n_train - args.n_val
    train_set, val_set, test_set = random_split(dataset, [args.n_train, args.n_val, n_test])

    y = dataset._data.y[:, args.target] if hasattr(dataset, "_data") else dataset.data.y[:, args.target]
    y_train = y[torch.as_tensor(train_set.indices)]
    mean, std = y_train.mean().item(), y_train.std().item()

    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler, num_workers=2)

    model = DimeNetPlusPlus(hidden_channels=128, out_channels=1, num_blocks=4, int_emb_size=64,
                            basis_emb_size=8, out_emb_channels=256, num_spherical=7, num_radial=6,
                            cutoff=5.0, envelope_exponent=5).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema))

    opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, amsgrad=True)

    def lr_lambda(step):
        warm = min(1.0, (step + 1) / args.warmup_steps)
        return warm * 0.01 ** (step / args.decay_steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    ckpt_path = os.path.join(args.logdir, "ckpt.pt")
    start_epoch, best_val = 0, float("inf")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best_val = ck["epoch"] + 1, ck["best_val"]

    target = TARGET_NAMES[args.target]
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        tot = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = ddp_model(data.z, data.pos, data.batch).view(-1)
            loss = F.l1_loss(pred, (data.y - mean) / std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 10.0)
            opt.step()
            sched.step()
            ema.update_parameters(model)
            tot += torch.stack([loss.detach() * data.num_graphs, torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(tot)

        val_mae = evaluate(ema.module, val_loader, device, mean, std)
        if rank == 0:
            train_mae = (tot[0] / tot[1]).item() * std
            print(f"epoch {epoch:4d} train MAE {train_mae:.5f} val MAE({target}) {val_mae:.5f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
            writer.add_scalar("mae/train", train_mae, epoch)
            writer.add_scalar("mae/val", val_mae, epoch)
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best_val": min(best_val, val_mae),
                        "mean": mean, "std": std}, ckpt_path)
            if val_mae < best_val:
                torch.save(ema.module.state_dict(), os.path.join(args.logdir, "best_ema.pt"))
        best_val = min(best_val, val_mae)
        dist.barrier()

    best = torch.load(os.path.join(args.logdir, "best_ema.pt"), map_location=device)
    ema.module.load_state_dict(best)
    test_mae = evaluate(ema.module, test_loader, device, mean, std)
    if rank == 0:
        print(f"test MAE({target}) = {test_mae:.5f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
