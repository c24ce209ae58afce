"""CGCNN baseline for OC20 IS2RE (initial structure -> relaxed energy).

* gradient accumulation (DDP no_sync on the inner micro-batches)
* BatchNorm inside the CGConv layers is converted to SyncBatchNorm
* wandb on the main process only; auto-resume from the run folder

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        14_cgcnn_oc20_is2re_accum.py --config configs/is2re_10k_cgcnn.yml
"""
import argparse
import contextlib
import math
import os
import pickle

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_geometric.nn import CGConv, global_mean_pool


class LmdbIS2RE(Dataset):
    def __init__(self, path):
        self.path = path
        self._env = None
        env = self._open()
        self._len = env.stat()["entries"]
        env.close()

    def _open(self):
        return lmdb.open(self.path, subdir=False, readonly=True, lock=False, readahead=False,
                         meminit=False, max_readers=1)

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        if self._env is None:  # opened per worker process
            self._env = self._open()
        with self._env.begin() as txn:
            d = pickle.loads(txn.get(f"{i}".encode("ascii")))
        d.atomic_numbers = d.atomic_numbers.long()
        return d


class CGCNN(nn.Module):
    def __init__(self, atom_dim=128, n_conv=6, fc_dim=128, n_gauss=50, cutoff=6.0):
        super().__init__()
        self.embedding = nn.Embedding(100, atom_dim)
        self.register_buffer("gauss_mu", torch.linspace(0.0, cutoff, n_gauss))
        self.gauss_coeff = -0.5 / (cutoff / (n_gauss - 1)) ** 2
        self.convs = nn.ModuleList([CGConv(atom_dim, dim=n_gauss, aggr="add", batch_norm=True)
                                    for _ in range(n_conv)])
        self.fc = nn.Sequential(nn.Linear(atom_dim, fc_dim), nn.Softplus(), nn.Linear(fc_dim, fc_dim),
                                nn.Softplus(), nn.Linear(fc_dim, 1))

    def forward(self, data):
        src, dst = data.edge_index
        offsets = torch.einsum("ei,eij->ej", data.cell_offsets.float(), data.cell[data.batch[src]])
        dist_ = (data.pos[src] - data.pos[dst] + offsets).norm(dim=-1)
        edge_attr = torch.exp(self.gauss_coeff * (dist_.unsqueeze(-1) - self.gauss_mu) ** 2)
        h = self.embedding(data.atomic_numbers)
        for conv in self.convs:
            h = conv(h, data.edge_index, edge_attr)
        return self.fc(global_mean_pool(h, data.batch)).view(-1)


@torch.no_grad()
def evaluate(net, loader, device, mean, std):
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        pred = net(data) * std + mean
        err = (pred - data.y_relaxed).abs()
        acc[0] += err.sum()
        acc[1] += (err < 0.02).sum()
        acc[2] += data.num_graphs
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", default=os.environ.get("RUN_DIR", "/shared/oc20_runs/cgcnn_is2re"))
    opts = ap.parse_args()
    cfg = yaml.safe_load(open(opts.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_set = LmdbIS2RE(cfg["train"])
    val_set = LmdbIS2RE(cfg["val_id"])
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["micro_batch"], sampler=sampler, drop_last=True,
                              num_workers=cfg["num_workers"], pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=cfg["eval_batch"],
                            num_workers=cfg["num_workers"])
    accum = cfg["accumulate"]  # global batch = micro_batch * accumulate * world

    model = CGCNN(**cfg["model"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("wd", 0.0))
    updates_per_epoch = math.ceil(len(train_loader) / accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["epochs"] * updates_per_epoch)
    mean, std = cfg["target_mean"], cfg["target_std"]

    ckpt_file = os.path.join(opts.run_dir, "checkpoint.pt")
    start_epoch, best = 0, float("inf")
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    run = None
    if rank == 0:
        os.makedirs(opts.run_dir, exist_ok=True)
        run = wandb.init(project="oc20-is2re", name=os.path.basename(opts.run_dir), config=cfg,
                         resume="allow", id=cfg.get("wandb_id"))

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        n_batches = len(train_loader)
        for it, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            sync_now = (it + 1) % accum == 0 or it + 1 == n_batches
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                pred = model(data)
                loss = nn.functional.l1_loss(pred, (data.y_relaxed - mean) / std) / accum
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip", 50.0))
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if run is not None and (it + 1) % (accum * 50) == 0:
                    run.log({"train/loss": loss.item() * accum, "lr": sched.get_last_lr()[0],
                             "epoch": epoch + it / n_batches})

        mae, ewt = evaluate(model.module, val_loader, device, mean, std)
        if rank == 0:
            run.log({"val_id/energy_mae": mae, "val_id/ewt": ewt, "epoch": epoch + 1})
            print(f"epoch {epoch}: val_id MAE {mae:.4f} eV, EwT {ewt * 100:.2f}%", flush=True)
            best = min(best, mae)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
