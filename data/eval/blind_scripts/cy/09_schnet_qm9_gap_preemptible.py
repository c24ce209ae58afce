"""SchNet on the QM9 HOMO-LUMO gap, written for a preemptible partition.

Checkpoints every --ckpt-every steps and automatically resumes from
<out>/latest.pt when the job is requeued.

    torchrun --nproc_per_node=4 09_schnet_qm9_gap_preemptible.py --out /scratch/$USER/schnet_gap
"""
import argparse
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

GAP = 4  # eV in PyG's QM9 target table

logger = logging.getLogger(__name__)
STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


def args_from_cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/QM9")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--total-steps", type=int, default=1_000_000)
    p.add_argument("--ckpt-every", type=int, default=5000)
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Standardize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def fwd(self, y):
        return (y - self.mean) / self.std

    def inv(self, y):
        return y * self.std + self.mean


def save(path, model, opt, sched, step, epoch, best):
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "epoch": epoch, "best": best}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def run_eval(net, loader, scaler, device):
    net.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for b in loader:
        b = b.to(device)
        pred = scaler.inv(net(b.z, b.pos, b.batch).squeeze(-1))
        s[0] += (pred - b.y[:, GAP]).abs().sum()
        s[1] += b.num_graphs
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = args_from_cli()
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        QM9(args.root)
    dist.barrier()
    ds = QM9(args.root)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_idx, val_idx, test_idx = perm[:110_000], perm[110_000:120_000], perm[120_000:]
    ys = ds.y[:, GAP] if hasattr(ds, "y") else ds.data.y[:, GAP]
    scaler = Standardize(ys[train_idx].mean().item(), ys[train_idx].std().item())

    train_set = Subset(ds, train_idx)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True)
    val_loader = DataLoader(Subset(ds, val_idx[rank::world]), batch_size=256, num_workers=2)
    test_loader = DataLoader(Subset(ds, test_idx[rank::world]), batch_size=256, num_workers=2)

    model = SchNet(hidden_channels=128, num_filters=128, num_interactions=6, num_gaussians=50,
                   cutoff=args.cutoff).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.96 ** (s / 100_000))

    latest = os.path.join(args.out, "latest.pt")
    step, epoch, best = 0, 0, float("inf")
    if os.path.exists(latest):
        ckpt = torch.load(latest)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, epoch, best = ckpt["step"], ckpt["epoch"], ckpt["best"]
        logger.info("resumed from step %d (epoch %d)", step, epoch)

    done = False
    while not done:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            pred = model(batch.z, batch.pos, batch.batch).squeeze(-1)
            loss = F.mse_loss(pred, scaler.fwd(batch.y[:, GAP]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

            if step % 500 == 0:
                logger.info("step %d loss %.4f %.1f ms/it", step, loss.item(), (time.time() - t0) * 2)
                t0 = time.time()
            if step % args.eval_every == 0:
                mae = run_eval(model.module, val_loader, scaler, device)
                logger.info("step %d val MAE %.4f eV", step, mae)
                if rank == 0 and mae < best:
                    best = mae
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
                model.train()

            stop = torch.tensor(int(STOP), device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if step % args.ckpt_every == 0 or stop.item() or step >= args.total_steps:
                if rank == 0:
                    save(latest, model, opt, sched, step, epoch, best)
                dist.barrier()
            if stop.item():
                logger.info("SIGTERM received, exiting for requeue at step %d", step)
                dist.destroy_process_group()
                sys.exit(0)
            if step >= args.total_steps:
                done = True
                break
        else:
            epoch += 1

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best_model.pt"), map_location=device))
    logger.info("test MAE %.4f eV", run_eval(model.module, test_loader, scaler, device))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
