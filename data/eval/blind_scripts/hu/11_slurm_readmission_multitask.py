"""Multi-hospital 30-day readmission transformer, launched directly by Slurm (one task per GPU).

sbatch wrapper (abridged):
    #SBATCH --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=29533
    srun python 11_slurm_readmission_multitask.py --data_root /gpfs/ehr/consortium_v2 \
        --run_dir /gpfs/ehr/runs/readmit_mt_$SLURM_JOB_ID

Auxiliary length-of-stay regression head is only trained every `--aux_every` steps.
"""
import argparse
import datetime
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--run_dir", required=True)
    p.add_argument("--max_visits", type=int, default=32)
    p.add_argument("--max_codes", type=int, default=48)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch_per_gpu", type=int, default=64)
    p.add_argument("--base_lr", type=float, default=1e-4, help="lr for a global batch of 256")
    p.add_argument("--warmup_epochs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--aux_every", type=int, default=4)
    p.add_argument("--aux_weight", type=float, default=0.2)
    return p.parse_args()


def slurm_dist_init():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=60))
    return rank, world, local_rank


def build_cache(data_root, cache_path, max_visits, max_codes):
    """Tokenize every hospital's admissions table into fixed-size arrays (slow, ~20 min)."""
    import pandas as pd

    adm = pd.concat([pd.read_parquet(os.path.join(data_root, h, "admissions.parquet")).assign(site=i)
                     for i, h in enumerate(sorted(os.listdir(data_root)))
                     if os.path.isdir(os.path.join(data_root, h))])
    out = {}
    for split, part in adm.groupby("split"):
        n = part.patient_key.nunique()
        codes = np.zeros((n, max_visits, max_codes), dtype=np.int32)
        gaps = np.zeros((n, max_visits), dtype=np.float32)
        y = np.zeros(n, dtype=np.float32)
        los = np.zeros(n, dtype=np.float32)
        site = np.zeros(n, dtype=np.int64)
        for k, (_, g) in enumerate(part.sort_values("admit_ts").groupby("patient_key", sort=True)):
            g = g.tail(max_visits)
            for t, row in enumerate(g.itertuples()):
                c = row.code_ids[:max_codes]
                codes[k, t, : len(c)] = c
                gaps[k, t] = row.days_since_prev
            y[k], los[k], site[k] = g.readmit_30d.iloc[-1], np.log1p(g.los_days.iloc[-1]), g.site.iloc[-1]
        out[split] = dict(codes=codes, gaps=gaps, y=y, los=los, site=site)
    tmp = cache_path + ".partial"
    with open(tmp, "wb") as f:
        pickle.dump(out, f, protocol=4)
    os.replace(tmp, cache_path)


class Admissions(Dataset):
    def __init__(self, d):
        self.d = d

    def __len__(self):
        return len(self.d["y"])

    def __getitem__(self, i):
        return (torch.from_numpy(self.d["codes"][i].astype(np.int64)), torch.from_numpy(self.d["gaps"][i]),
                self.d["site"][i], self.d["y"][i], self.d["los"][i], i)


class VisitTransformer(nn.Module):
    def __init__(self, vocab, n_sites, d, layers, max_visits):
        super().__init__()
        self.codes = nn.EmbeddingBag(vocab, d, mode="sum", padding_idx=0)
        self.pos = nn.Embedding(max_visits, d)
        self.gap = nn.Linear(1, d)
        self.site = nn.Embedding(n_sites, d)
        enc = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.readmit_head = nn.Linear(d, 1)
        self.los_head = nn.Sequential(nn.Linear(d, d // 2), nn.GELU(), nn.Linear(d // 2, 1))

    def forward(self, codes, gaps, site, with_aux=False):
        B, V, C = codes.shape
        v = self.codes(codes.view(B * V, C)).view(B, V, -1)
        pad = (codes.sum(-1) == 0)
        x = v + self.pos.weight[:V] + self.gap(torch.log1p(gaps).unsqueeze(-1)) + self.site(site).unsqueeze(1)
        h = self.encoder(x, src_key_padding_mask=pad)
        last = (~pad).sum(1).clamp(min=1) - 1
        z = h[torch.arange(B, device=h.device), last]
        logit = self.readmit_head(z).squeeze(-1)
        if with_aux:
            return logit, self.los_head(z).squeeze(-1)
        return logit


@torch.no_grad()
def auroc_all(model, ds, device, rank, world):
    sub = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    dl = DataLoader(sub, batch_size=512, num_workers=4)
    p = torch.zeros(len(ds), device=device)
    model.eval()
    for codes, gaps, site, _, _, idx in dl:
        p[idx.to(device)] = torch.sigmoid(model(codes.to(device), gaps.to(device), site.to(device)))
    dist.all_reduce(p)
    return roc_auc_score(ds.d["y"], p.cpu().numpy())


def main():
    args = args_()
    rank, world, local_rank = slurm_dist_init()
    device = torch.device("cuda", local_rank)

    cache = os.path.join(args.data_root, f"cache_v{args.max_visits}x{args.max_codes}.pkl")
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.data_root, cache, args.max_visits, args.max_codes)
    dist.barrier()
    with open(cache, "rb") as f:
        data = pickle.load(f)
    with open(os.path.join(args.data_root, "vocab_size.txt")) as f:
        vocab = int(f.read())
    n_sites = int(max(data[s]["site"].max() for s in data)) + 1

    train_ds, val_ds = Admissions(data["train"]), Admissions(data["val"])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, persistent_workers=True)

    model = VisitTransformer(vocab, n_sites, args.d, args.layers, args.max_visits).to(device)
    # los_head gets no gradient on steps without the auxiliary loss
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    global_batch = args.batch_per_gpu * world
    lr = args.base_lr * global_batch / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = args.warmup_epochs * len(loader)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))

    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        if ck["world"] == world:
            model.module.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            start = ck["epoch"] + 1
    if rank == 0:
        print(f"world={world} global_batch={global_batch} lr={lr:.2e} start_epoch={start}", flush=True)

    step = start * len(loader)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for codes, gaps, site, y, los, _ in loader:
            codes, gaps, site = codes.to(device, non_blocking=True), gaps.to(device), site.to(device)
            y, los = y.to(device).float(), los.to(device).float()
            if step % args.aux_every == 0:
                logit, los_hat = model(codes, gaps, site, with_aux=True)
                loss = F.binary_cross_entropy_with_logits(logit, y) + args.aux_weight * F.mse_loss(los_hat, los)
            else:
                loss = F.binary_cross_entropy_with_logits(model(codes, gaps, site), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1

        auc = auroc_all(model.module, val_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} val AUROC {auc:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "world": world, "val_auroc": auc}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
