"""DimeNet++ on QM9, one target at a time, multi-GPU with DDP.

Reproduces the DimeNet++ protocol: 110k/10k/rest split, warmup + exponential
decay, EMA of the weights for evaluation.

    torchrun --nproc_per_node=8 03_dimenetpp_qm9.py --target 7 --out runs/dpp_u0
"""
import argparse
import copy
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import DimeNetPlusPlus

log = logging.getLogger("dimenet")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/QM9")
    p.add_argument("--out", default="runs/dpp")
    p.add_argument("--target", type=int, default=7)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=3000)
    p.add_argument("--decay-steps", type=int, default=4_000_000)
    p.add_argument("--decay-rate", type=float, default=0.01)
    p.add_argument("--max-steps", type=int, default=3_000_000)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--eval-interval", type=int, default=10000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def lr_lambda(args):
    def f(step):
        warm = min(1.0, (step + 1) / args.warmup_steps)
        return warm * args.decay_rate ** (step / args.decay_steps)
    return f


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
        p_ema.mul_(decay).add_(p.detach(), alpha=1.0 - decay)


@torch.no_grad()
def evaluate(model, loader, target, mean, std, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch.z, batch.pos, batch.batch).view(-1) * std + mean
        acc[0] += (pred - batch.y[:, target]).abs().sum()
        acc[1] += batch.num_graphs
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    seed_everything(args.seed + rank)

    if rank == 0:
        QM9(args.root)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    dataset = QM9(args.root)

    idx = np.random.permutation(len(dataset))
    train_idx, val_idx, test_idx = idx[:110000], idx[110000:120000], idx[120000:]
    train_set = Subset(dataset, train_idx.tolist())
    val_set = Subset(dataset, val_idx[rank::world].tolist())
    test_set = Subset(dataset, test_idx[rank::world].tolist())

    y = dataset.data.y[torch.as_tensor(train_idx), args.target]
    mean, std = y.mean().item(), y.std().item()
    log.info("target %d: mean %.4f std %.4f", args.target, mean, std)

    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=64, num_workers=2)

    model = DimeNetPlusPlus(
        hidden_channels=128, out_channels=1, num_blocks=4, int_emb_size=64,
        basis_emb_size=8, out_emb_channels=256, num_spherical=7, num_radial=6,
        cutoff=5.0, envelope_exponent=5, num_before_skip=1, num_after_skip=2,
        num_output_layers=3,
    ).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    # EMA shadow of the weights, used for validation and test
    ema_model = copy.deepcopy(model.module).eval()
    for p in ema_model.parameters():
        p.requires_grad_(False)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    step, epoch, best = 0, 0, float("inf")
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            target = (batch.y[:, args.target] - mean) / std
            pred = model(batch.z, batch.pos, batch.batch).view(-1)
            loss = F.l1_loss(pred, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            opt.step()
            sched.step()
            ema_update(ema_model, model.module, args.ema)
            step += 1

            if step % 1000 == 0:
                log.info("step %d loss %.4f lr %.2e", step, loss.item(), sched.get_last_lr()[0])

            if step % args.eval_interval == 0:
                val_mae = evaluate(ema_model, val_loader, args.target, mean, std, device)
                log.info("step %d | val MAE (EMA) %.5f", step, val_mae)
                if rank == 0 and val_mae < best:
                    best = val_mae
                    torch.save({"ema": ema_model.state_dict(), "model": model.module.state_dict(),
                                "step": step, "mean": mean, "std": std},
                               os.path.join(args.out, "best.pt"))
                model.train()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    ema_model.load_state_dict(ckpt["ema"])
    test_mae = evaluate(ema_model, test_loader, args.target, mean, std, device)
    log.info("test MAE %.5f (best val %.5f)", test_mae, best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
