"""ESMM (CTR + CTCVR) on streamed daily logs.

Launch: torchrun --nnodes=2 --nproc_per_node=8 ... 02_esmm_join_stream.py --config esmm.yaml
"""
import argparse
import dataclasses
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


@dataclasses.dataclass
class Config:
    train_glob: str = "/data/ads/esmm/train/dt=*/part-*.npz"
    eval_glob: str = "/data/ads/esmm/eval/part-*.npz"
    num_fields: int = 24
    bucket_size: int = 100_000
    emb_dim: int = 16
    tower: tuple = (256, 128, 64)
    batch_size: int = 2048
    lr: float = 5e-4
    weight_decay: float = 1e-6
    epochs: int = 1
    ckpt_dir: str = "/shared/esmm/ckpt"
    resume: str = ""
    wandb_project: str = "esmm-cvr"
    seed: int = 2024


class NpzShardStream(IterableDataset):
    """Each rank reads its own subset of part files; part sizes differ."""

    def __init__(self, files, batch_size, rank, world_size, seed=0):
        self.files = sorted(files)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        files = self.files[self.rank::self.world_size]
        info = get_worker_info()
        if info is not None:
            files = files[info.id::info.num_workers]
        rng = np.random.default_rng(self.seed + self.epoch)
        files = list(files)
        rng.shuffle(files)
        for path in files:
            with np.load(path) as z:
                feats, click, conv = z["feats"], z["click"], z["conv"]
            order = rng.permutation(len(click))
            for s in range(0, len(order), self.batch_size):
                idx = order[s:s + self.batch_size]
                yield (torch.from_numpy(feats[idx].astype(np.int64)),
                       torch.from_numpy(click[idx].astype(np.float32)),
                       torch.from_numpy(conv[idx].astype(np.float32)))


def tower(in_dim, dims):
    layers = []
    for d in dims:
        layers += [nn.Linear(in_dim, d), nn.ReLU()]
        in_dim = d
    layers.append(nn.Linear(in_dim, 1))
    return nn.Sequential(*layers)


class ESMM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.num_fields = cfg.num_fields
        self.bucket_size = cfg.bucket_size
        # one shared table, each field gets its own offset range
        self.embedding = nn.Embedding(cfg.num_fields * cfg.bucket_size, cfg.emb_dim)
        nn.init.normal_(self.embedding.weight, std=0.01)
        self.register_buffer("offsets", torch.arange(cfg.num_fields) * cfg.bucket_size,
                             persistent=False)
        in_dim = cfg.num_fields * cfg.emb_dim
        self.ctr_tower = tower(in_dim, cfg.tower)
        self.cvr_tower = tower(in_dim, cfg.tower)

    def forward(self, feats):
        x = self.embedding(feats % self.bucket_size + self.offsets).flatten(1)
        p_ctr = torch.sigmoid(self.ctr_tower(x)).squeeze(1)
        p_cvr = torch.sigmoid(self.cvr_tower(x)).squeeze(1)
        return p_ctr, p_ctr * p_cvr


def esmm_loss(p_ctr, p_ctcvr, click, conv):
    eps = 1e-7
    l_ctr = F.binary_cross_entropy(p_ctr.clamp(eps, 1 - eps), click)
    l_ctcvr = F.binary_cross_entropy(p_ctcvr.clamp(eps, 1 - eps), click * conv)
    return l_ctr + l_ctcvr, l_ctr.detach(), l_ctcvr.detach()


@torch.no_grad()
def evaluate(net, files, cfg, rank, world_size, device):
    """Runs on the unwrapped module; every rank scores its own part files."""
    from sklearn.metrics import roc_auc_score

    net.eval()
    stream = NpzShardStream(files, 8192, rank, world_size)
    preds_ctr, preds_ctcvr, clicks, convs = [], [], [], []
    for feats, click, conv in DataLoader(stream, batch_size=None, num_workers=2):
        p_ctr, p_ctcvr = net(feats.to(device))
        preds_ctr.append(p_ctr.cpu())
        preds_ctcvr.append(p_ctcvr.cpu())
        clicks.append(click)
        convs.append(conv)
    net.train()
    local = {
        "ctr": torch.cat(preds_ctr).numpy() if preds_ctr else np.zeros(0, np.float32),
        "ctcvr": torch.cat(preds_ctcvr).numpy() if preds_ctcvr else np.zeros(0, np.float32),
        "click": torch.cat(clicks).numpy() if clicks else np.zeros(0, np.float32),
        "conv": torch.cat(convs).numpy() if convs else np.zeros(0, np.float32),
    }
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return None
    merged = {k: np.concatenate([g[k] for g in gathered]) for k in local}
    y_ctcvr = merged["click"] * merged["conv"]
    return {
        "auc_ctr": float(roc_auc_score(merged["click"], merged["ctr"])),
        "auc_ctcvr": float(roc_auc_score(y_ctcvr, merged["ctcvr"])),
        "n": int(len(merged["click"])),
    }


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, tuple(v) if isinstance(v, list) else v)
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)

    run = None
    if rank == 0:
        import wandb
        run = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg))

    net = ESMM(cfg).to(device)
    start_epoch = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.resume:
        opt.load_state_dict(ckpt["optim"])

    train_files = glob.glob(cfg.train_glob)
    eval_files = glob.glob(cfg.eval_glob)
    stream = NpzShardStream(train_files, cfg.batch_size, rank, world_size, seed=cfg.seed)
    loader = DataLoader(stream, batch_size=None, num_workers=6, pin_memory=True)

    for epoch in range(start_epoch, cfg.epochs):
        stream.set_epoch(epoch)
        model.train()
        n_steps, sum_ctr, sum_ctcvr, t0 = 0, 0.0, 0.0, time.time()
        # part files are not the same size, so ranks run out of batches at different steps
        with Join([model]):
            for feats, click, conv in loader:
                feats = feats.to(device, non_blocking=True)
                click = click.to(device, non_blocking=True)
                conv = conv.to(device, non_blocking=True)
                p_ctr, p_ctcvr = model(feats)
                loss, l_ctr, l_ctcvr = esmm_loss(p_ctr, p_ctcvr, click, conv)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                n_steps += 1
                sum_ctr += l_ctr.item()
                sum_ctcvr += l_ctcvr.item()
                if rank == 0 and n_steps % 500 == 0:
                    run.log({"train/ctr_loss": sum_ctr / n_steps,
                             "train/ctcvr_loss": sum_ctcvr / n_steps,
                             "train/steps_per_s": n_steps / (time.time() - t0)})

        totals = torch.tensor([n_steps, sum_ctr, sum_ctcvr], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        metrics = evaluate(model.module, eval_files, cfg, rank, world_size, device)
        if rank == 0:
            metrics.update({"epoch": epoch,
                            "train/ctr_loss_epoch": (totals[1] / totals[0]).item(),
                            "train/ctcvr_loss_epoch": (totals[2] / totals[0]).item()})
            run.log(metrics)
            print(json.dumps(metrics), flush=True)
            os.makedirs(cfg.ckpt_dir, exist_ok=True)
            tmp = os.path.join(cfg.ckpt_dir, f".epoch{epoch}.pt.tmp")
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                        "epoch": epoch, "cfg": dataclasses.asdict(cfg)}, tmp)
            os.replace(tmp, os.path.join(cfg.ckpt_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
