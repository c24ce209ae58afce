"""DimeNet++ on QM9 with DistributedDataParallel.

Run:
    torchrun --nproc_per_node=4 14_qm9_dimenetpp.py --target 2 --data_dir ./data/QM9
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import DimeNetPlusPlus

parser = argparse.ArgumentParser(description="DimeNet++ QM9")
parser.add_argument("--data_dir", type=str, default="./data/QM9")
parser.add_argument("--target", type=int, default=2, help="QM9 target column (2 = HOMO)")
parser.add_argument("--epochs", type=int, default=800)
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--warmup_steps", type=int, default=3000)
parser.add_argument("--decay_rate", type=float, default=0.01)
parser.add_argument("--decay_steps", type=int, default=4000000)
parser.add_argument("--ema_decay", type=float, default=0.999)
parser.add_argument("--save_dir", type=str, default="./checkpoints")
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--seed", type=int, default=42)


class EMA:
    def __init__(self, model, decay):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model):
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
            else:
                self.shadow[k].copy_(v)

    def swap(self, model):
        current = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.shadow)
        self.shadow = current


def lr_lambda(step, args):
    warm = min(1.0, (step + 1) / args.warmup_steps)
    return warm * args.decay_rate ** (step / args.decay_steps)


@torch.no_grad()
def evaluate(model, loader, target, device):
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.z, batch.pos, batch.batch).squeeze(-1)
        total[0] += (out - batch.y[:, target]).abs().sum()
        total[1] += batch.num_graphs
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main():
    args = parser.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        QM9(args.data_dir)
        os.makedirs(args.save_dir, exist_ok=True)
    dist.barrier()
    dataset = QM9(args.data_dir)

    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    train_set = Subset(dataset, perm[:110000].tolist())
    val_set = Subset(dataset, perm[110000:120000][rank::world_size].tolist())
    test_set = Subset(dataset, perm[120000:][rank::world_size].tolist())

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=64, num_workers=2)

    model = DimeNetPlusPlus(
        hidden_channels=128, out_channels=1, num_blocks=4, int_emb_size=64, basis_emb_size=8,
        out_emb_channels=256, num_spherical=7, num_radial=6, cutoff=5.0, max_num_neighbors=32,
        envelope_exponent=5, num_before_skip=1, num_after_skip=2, num_output_layers=3,
    ).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    ema = EMA(model.module, args.ema_decay)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, args))

    best_val = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.z, batch.pos, batch.batch).squeeze(-1)
            loss = F.l1_loss(out, batch.y[:, args.target])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            ema.update(model.module)

        # validate with the EMA weights
        ema.swap(model.module)
        val_mae = evaluate(model, val_loader, args.target, device)
        if rank == 0:
            print(f"Epoch {epoch:4d} | val MAE {val_mae * 1000:.2f} meV | {time.time() - start:.1f}s", flush=True)
            if val_mae < best_val:
                best_val = val_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_mae": val_mae},
                           os.path.join(args.save_dir, f"dimenetpp_t{args.target}.pt"))
        ema.swap(model.module)

    dist.barrier()
    ckpt = torch.load(os.path.join(args.save_dir, f"dimenetpp_t{args.target}.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_mae = evaluate(model, test_loader, args.target, device)
    if rank == 0:
        print(f"Test MAE (best-val EMA weights, epoch {ckpt['epoch']}): {test_mae * 1000:.2f} meV")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
