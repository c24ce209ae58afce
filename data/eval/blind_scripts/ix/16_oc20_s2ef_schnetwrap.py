"""Minimal OC20 S2EF trainer around ocpmodels' SchNetWrap (instead of the full OCP trainer).

Graphs are built on the fly (otf_graph=True), energies and forces are normalised
with the S2EF-2M statistics, and forces are the negative gradient of the energy.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=gpu-a01:29400 \
        16_oc20_s2ef_schnetwrap.py --train /datasets/oc20/s2ef/2M/train --val /datasets/oc20/s2ef/all/val_id
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from ocpmodels.datasets import LmdbDataset
from ocpmodels.models.schnet import SchNetWrap
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader

logger = logging.getLogger(__name__)


class Normalizer:
    def __init__(self, mean, std, device):
        self.mean = torch.tensor(mean, device=device)
        self.std = torch.tensor(std, device=device)

    def norm(self, x):
        return (x - self.mean) / self.std

    def denorm(self, x):
        return x * self.std + self.mean


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--run_dir", default="/checkpoint/oc20/schnet_s2ef_2M")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch_size", type=int, default=24)
    p.add_argument("--eval_batch_size", type=int, default=24)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lr_gamma", type=float, default=0.1)
    p.add_argument("--lr_milestones", type=int, nargs="+", default=[52083, 83333, 104166])
    p.add_argument("--warmup_steps", type=int, default=31250)
    p.add_argument("--force_coefficient", type=float, default=100.0)
    # S2EF-2M target statistics (energy mean/std, force std) as used in the OCP configs
    p.add_argument("--energy_mean", type=float, default=-0.7554450631141663)
    p.add_argument("--energy_std", type=float, default=2.887317180633545)
    p.add_argument("--force_std", type=float, default=2.887317180633545)
    p.add_argument("--num_workers", type=int, default=8)
    return p.parse_args()


def lr_factor(step, args):
    if step < args.warmup_steps:
        return 0.2 + 0.8 * step / args.warmup_steps
    return args.lr_gamma ** sum(step >= m for m in args.lr_milestones)


@torch.no_grad()
def validate(model, loader, device, e_norm, f_norm):
    model.eval()
    m = torch.zeros(5, dtype=torch.float64, device=device)
    for batch in loader:
        batch = batch.to(device)
        with torch.enable_grad():
            energy, forces = model(batch)
        energy = e_norm.denorm(energy.view(-1))
        forces = f_norm.denorm(forces)
        m[0] += (energy - batch.y).abs().sum()
        m[1] += batch.num_graphs
        m[2] += (forces - batch.force).abs().sum()
        m[3] += forces.numel()
        m[4] += ((forces - batch.force).norm(dim=-1) < 0.03).sum()
    dist.all_reduce(m)
    return {"energy_mae": (m[0] / m[1]).item(), "forces_mae": (m[2] / m[3]).item(),
            "forces_within_30meV": (3 * m[4] / m[3]).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    train_ds = LmdbDataset({"src": args.train})
    val_ds = LmdbDataset({"src": args.val})
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.eval_batch_size, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = SchNetWrap(
        num_atoms=None, bond_feat_dim=None, num_targets=1,
        use_pbc=True, regress_forces=True, otf_graph=True,
        hidden_channels=1024, num_filters=256, num_interactions=5, num_gaussians=200, cutoff=6.0,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args))

    e_norm = Normalizer(args.energy_mean, args.energy_std, device)
    f_norm = Normalizer(0.0, args.force_std, device)

    ckpt_file = os.path.join(args.run_dir, "checkpoint.pt")
    start_epoch, best_fmae = 0, float("inf")
    if os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_fmae = ckpt["epoch"] + 1, ckpt["best_fmae"]
        logger.info("resumed at epoch %d", start_epoch)
    elif rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        for i, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            energy, forces = model(batch)
            e_loss = (energy.view(-1) - e_norm.norm(batch.y)).abs().mean()
            free = batch.fixed == 0
            f_loss = (forces[free] - f_norm.norm(batch.force[free])).abs().mean()
            loss = e_loss + args.force_coefficient * f_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (e %.4f f %.4f) lr %.2e", epoch, i, len(train_loader),
                            loss.item(), e_loss.item(), f_loss.item(), scheduler.get_last_lr()[0])

        metrics = validate(model.module, val_loader, device, e_norm, f_norm)
        logger.info("epoch %d finished in %.0fs | %s", epoch, time.time() - tic,
                    " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if rank == 0:
            best_fmae = min(best_fmae, metrics["forces_mae"])
            state = {"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_fmae": best_fmae}
            torch.save(state, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
            if metrics["forces_mae"] <= best_fmae:
                torch.save(state, os.path.join(args.run_dir, "best_checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
