"""Audio tagging (CNN14-style) on AudioSet, launched one task per GPU by srun.

    #SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10
    #SBATCH --signal=USR1@240 --requeue
    srun --kill-on-bad-exit=1 python train_tagging.py --config conf/cnn14.yaml
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from tagging.data import AudioSetH5

STOP = {"requested": False}


def on_usr1(signum, frame):
    STOP["requested"] = True


def slurm_env():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                    text=True).split()
    os.environ["MASTER_ADDR"] = hosts[0]
    os.environ["MASTER_PORT"] = str(15000 + int(os.environ["SLURM_JOB_ID"]) % 10000)
    return rank, world, local_rank


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return F.avg_pool2d(x, 2)


class CNN14(nn.Module):
    def __init__(self, n_classes=527):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(64)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.Sequential(*[ConvBlock(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc = nn.Linear(2048, 2048)
        self.head = nn.Linear(2048, n_classes)

    def forward(self, mel):  # B, T, 64
        x = self.bn0(mel.unsqueeze(1).transpose(1, 3)).transpose(1, 3)
        x = self.blocks(x).mean(3)
        x = x.max(2).values + x.mean(2)
        return self.head(F.relu(self.fc(F.dropout(x, 0.5, self.training))))


@torch.no_grad()
def evaluate(net, loader, rank, world):
    net.eval()
    scores, targets = [], []
    for mel, y in loader:
        scores.append(torch.sigmoid(net(mel.cuda(non_blocking=True))).cpu())
        targets.append(y)
    local = (torch.cat(scores), torch.cat(targets))
    parts = [None] * world if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    net.train()
    if rank != 0:
        return None
    s = torch.cat([p[0] for p in parts]).numpy()
    t = torch.cat([p[1] for p in parts]).numpy()
    keep = t.sum(0) > 0
    return float(average_precision_score(t[:, keep], s[:, keep], average="macro"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    rank, world, local_rank = slurm_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    signal.signal(signal.SIGUSR1, on_usr1)
    torch.manual_seed(cfg["seed"])

    train_ds = AudioSetH5(cfg["train_h5"], mixup=False)
    eval_ds = AudioSetH5(cfg["eval_h5"])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                 seed=cfg["seed"], drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=64,
                             num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(CNN14(cfg["n_classes"])).cuda()
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])

    run_dir = cfg["run_dir"]  # /lustre/... visible from every node
    ckpt = os.path.join(run_dir, "last.pt")
    epoch, it0, best_map = 0, 0, 0.0
    if os.path.exists(ckpt):
        s = torch.load(ckpt, map_location="cpu")
        net.load_state_dict(s["model"])
        optimizer.load_state_dict(s["optimizer"])
        epoch, it0, best_map = s["epoch"], s["iter"], s["best_map"]
        if s["world"] == world:
            torch.set_rng_state(s["rng"][rank]["cpu"])
            torch.cuda.set_rng_state(s["rng"][rank]["cuda"])
        else:
            it0 = 0  # another sharding: restart this epoch rather than skip the wrong samples

    writer = SummaryWriter(os.path.join(run_dir, "tb")) if rank == 0 else None
    if local_rank == 0:
        os.makedirs(os.path.join(run_dir, "nodes"), exist_ok=True)
    node_stats = os.path.join(run_dir, "nodes", f"{socket.gethostname()}.json")

    def checkpoint(ep, it):
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
        all_rng = [None] * world
        dist.all_gather_object(all_rng, rng)
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": ep,
                        "iter": it, "best_map": best_map, "world": world, "rng": all_rng}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()

    stop = torch.zeros(1, device="cuda")
    while epoch < cfg["epochs"]:
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (mel, y) in enumerate(loader):
            if it < it0:
                continue
            mel, y = mel.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(mel)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/bce", l.item(), epoch * len(loader) + it)
                if local_rank == 0:
                    with open(node_stats, "w") as f:
                        json.dump({"epoch": epoch, "iter": it, "mem_gb": torch.cuda.max_memory_allocated() / 2**30,
                                   "sec_per_iter": (time.time() - t0) / (it - it0 + 1)}, f)

            stop[0] = float(STOP["requested"])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                checkpoint(epoch, it + 1)
                if rank == 0:
                    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
                    writer.close()
                dist.destroy_process_group()
                return

        it0 = 0
        mAP = evaluate(net, eval_loader, rank, world)
        if rank == 0:
            writer.add_scalar("eval/mAP", mAP, epoch)
            print(f"epoch {epoch} mAP {mAP:.4f}", flush=True)
            if mAP > best_map:
                best_map = mAP
                torch.save(net.state_dict(), os.path.join(run_dir, "best.pt"))
        epoch += 1
        checkpoint(epoch, 0)

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
