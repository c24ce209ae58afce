"""
DeepHit (discrete-time) for CKD progression to stage 5 / dialysis.

Features: last eGFR trajectory summary, labs, meds, comorbidities at index date.
Durations are binned into monthly intervals up to 60 months.

torchrun --nproc_per_node=4 08_deephit_ckd_progression.py --train /data/ckd/train.parquet \
    --val /data/ckd/val.parquet --out /data/ckd/runs/deephit
"""
import argparse
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("deephit")
N_BINS = 60


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=0.3, help="weight of NLL vs ranking loss")
    p.add_argument("--sigma", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


class CKDCohort(Dataset):
    def __init__(self, path, feat_cols=None, stats=None):
        df = pd.read_parquet(path)
        self.feat_cols = feat_cols or [c for c in df.columns if c.startswith(("lab_", "med_", "dx_", "egfr_", "demo_"))]
        x = df[self.feat_cols].astype("float32")
        if stats is None:
            stats = (x.mean(), x.std().replace(0, 1.0))
        self.stats = stats
        self.x = ((x - stats[0]) / stats[1]).fillna(0.0).values.astype(np.float32)
        months = np.clip(df.time_to_event_days.values / 30.44, 0, N_BINS - 1e-3)
        self.t_bin = np.floor(months).astype(np.int64)
        self.t_cont = months.astype(np.float32)
        self.event = df.progressed.values.astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.t_bin[i], self.event[i]


class DeepHit(nn.Module):
    def __init__(self, d_in, hidden, n_bins):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(hidden, n_bins + 1),  # last bin = survives beyond horizon
        )

    def forward(self, x):
        return self.net(x)


def deephit_loss(logits, t_bin, event, alpha, sigma):
    pmf = torch.softmax(logits, dim=1)[:, :-1]
    cif = torch.cumsum(pmf, dim=1)
    idx = t_bin.unsqueeze(1)
    # likelihood: event -> pmf at t, censored -> survival past t
    p_event = pmf.gather(1, idx).squeeze(1).clamp_min(1e-8)
    p_surv = (1.0 - cif.gather(1, idx).squeeze(1)).clamp_min(1e-8)
    nll = -(event * p_event.log() + (1 - event) * p_surv.log()).mean()

    # ranking: i had the event before j's time -> CIF_i(t_i) > CIF_j(t_i)
    F_at_ti = cif[:, t_bin]  # [j, i] = CIF_j(t_i)
    diag = torch.diagonal(F_at_ti)
    acceptable = (event.unsqueeze(1) > 0) & (t_bin.unsqueeze(1) < t_bin.unsqueeze(0))  # [i, j]
    rank = torch.exp(-(diag.unsqueeze(1) - F_at_ti.t()) / sigma) * acceptable
    rank_loss = rank.sum() / acceptable.sum().clamp_min(1)
    return alpha * nll + (1 - alpha) * rank_loss


def td_concordance(cif, t, e):
    """Antolini's time-dependent C-index on the predicted CIF."""
    n = len(t)
    conc, comp = 0.0, 0.0
    for i in np.where(e == 1)[0]:
        j = t > t[i]
        comp += j.sum()
        conc += (cif[i, t[i]] > cif[j, t[i]]).sum()
    return conc / max(comp, 1)


@torch.no_grad()
def validate(model, ds, device):
    """Every rank scores the full (small) validation set; no communication needed."""
    model.eval()
    out = []
    for s in range(0, len(ds), 8192):
        x = torch.from_numpy(ds.x[s:s + 8192]).to(device)
        out.append(torch.cumsum(torch.softmax(model(x), 1)[:, :-1], 1).cpu())
    cif = torch.cat(out).numpy()
    return td_concordance(cif, ds.t_bin, ds.event)


def main():
    args = cli()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    train_ds = CKDCohort(args.train)
    val_ds = CKDCohort(args.val, train_ds.feat_cols, train_ds.stats)
    LOG.info("train %d (events %.0f), val %d, features %d", len(train_ds), train_ds.event.sum(),
             len(val_ds), len(train_ds.feat_cols))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DeepHit(len(train_ds.feat_cols), args.hidden, N_BINS).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        stats = torch.zeros(2, device=device)
        for x, tb, ev in loader:
            x, tb, ev = x.to(device, non_blocking=True), tb.to(device), ev.to(device)
            loss = deephit_loss(model(x), tb, ev, args.alpha, args.sigma)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats[0] += loss.detach()
            stats[1] += 1
        sched.step()
        dist.all_reduce(stats)
        mean_loss = (stats[0] / stats[1]).item()

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            if rank == 0:
                c = validate(model.module, val_ds, device)
                LOG.info("epoch %d loss %.4f td-C %.4f lr %.1e", epoch, mean_loss, c, sched.get_last_lr()[0])
                if c > best:
                    best = c
                    torch.save({"model": model.module.state_dict(), "feat_cols": train_ds.feat_cols,
                                "stats": [s.to_dict() for s in train_ds.stats], "epoch": epoch},
                               os.path.join(args.out, "deephit_best.pt"))
            dist.barrier()
        else:
            LOG.info("epoch %d loss %.4f", epoch, mean_loss)

    LOG.info("best td-C %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
