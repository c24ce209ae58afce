"""
Deep Interest Network (DIN) CTR model for the shop-search ads auction.

Daily retrain job (Airflow -> Volcano/Kubeflow PyTorchJob, 2 workers x 4 A100):

    torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=$RUN_ID \
        din_train.py --date 2024-11-03 --days 14 \
        --data-root /mnt/feature-store/ads_search_ctr --out /mnt/models/din/2024-11-03

The model with the best eval AUC is exported and picked up by the offline AUC/calibration gate
before it is allowed to serve.
"""
import argparse
import datetime as dt
import os

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEQ_LEN = 100


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--date", required=True)
    p.add_argument("--days", type=int, default=14)
    p.add_argument("--data-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-items", type=int, default=3_000_000)
    p.add_argument("--n-cats", type=int, default=20_000)
    p.add_argument("--n-users", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args()


class CtrParquet(Dataset):
    COLS = ["user", "item", "cat", "hist_items", "hist_cats", "ctx", "label"]

    def __init__(self, files):
        tbl = pq.concat_tables([pq.read_table(f, columns=self.COLS) for f in files]).to_pydict()
        self.user = np.asarray(tbl["user"], dtype=np.int64)
        self.item = np.asarray(tbl["item"], dtype=np.int64)
        self.cat = np.asarray(tbl["cat"], dtype=np.int64)
        self.ctx = np.asarray(tbl["ctx"], dtype=np.float32)
        self.label = np.asarray(tbl["label"], dtype=np.float32)
        self.h_item = self._pad(tbl["hist_items"])
        self.h_cat = self._pad(tbl["hist_cats"])

    @staticmethod
    def _pad(seqs):
        out = np.zeros((len(seqs), SEQ_LEN), dtype=np.int64)
        for i, s in enumerate(seqs):
            s = s[-SEQ_LEN:]
            out[i, SEQ_LEN - len(s):] = s
        return out

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return (self.user[i], self.item[i], self.cat[i], self.h_item[i], self.h_cat[i],
                self.ctx[i], self.label[i])


class Dice(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.bn = nn.BatchNorm1d(d, affine=False)
        self.alpha = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        shape = x.shape
        p = torch.sigmoid(self.bn(x.reshape(-1, shape[-1]))).reshape(shape)
        return p * x + (1 - p) * self.alpha * x


class DIN(nn.Module):
    def __init__(self, a):
        super().__init__()
        d = a.dim
        self.item = nn.Embedding(a.n_items, d, padding_idx=0)
        self.cat = nn.Embedding(a.n_cats, d, padding_idx=0)
        self.user = nn.Embedding(a.n_users, d)
        self.att = nn.Sequential(nn.Linear(8 * d, 80), Dice(80), nn.Linear(80, 40), Dice(40), nn.Linear(40, 1))
        self.mlp = nn.Sequential(nn.Linear(5 * d + 16, 200), Dice(200), nn.Linear(200, 80), Dice(80), nn.Linear(80, 1))

    def forward(self, user, item, cat, h_item, h_cat, ctx):
        q = torch.cat([self.item(item), self.cat(cat)], -1)                 # B, 2d
        k = torch.cat([self.item(h_item), self.cat(h_cat)], -1)             # B, L, 2d
        qe = q.unsqueeze(1).expand_as(k)
        w = self.att(torch.cat([qe, k, qe - k, qe * k], -1)).squeeze(-1)    # B, L
        w = w.masked_fill(h_item == 0, 0.0)
        interest = (w.unsqueeze(-1) * k).sum(1)
        x = torch.cat([self.user(user % self.user.num_embeddings), q, interest, ctx], -1)
        return self.mlp(x).squeeze(-1)


def day_files(root, date, days):
    end = dt.date.fromisoformat(date)
    return [os.path.join(root, f"dt={(end - dt.timedelta(days=i)).isoformat()}", "part-0.parquet")
            for i in range(days, 0, -1)]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for batch in loader:
        *feats, y = [t.to(device, non_blocking=True) for t in batch]
        preds.append(torch.sigmoid(model(*feats).float()).cpu())
        labels.append(y.cpu())
    model.train()
    p = torch.cat(preds).numpy()
    y = torch.cat(labels).numpy()
    return roc_auc_score(y, p), log_loss(y, np.clip(p, 1e-7, 1 - 1e-7))


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = day_files(a.data_root, a.date, a.days)
    train_ds = CtrParquet(files[:-1])
    eval_ds = CtrParquet(files[-1:])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=8192, sampler=DistributedSampler(eval_ds, shuffle=False),
                         num_workers=4, pin_memory=True)

    torch.manual_seed(2024)
    model = DIN(a).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        wandb.init(project="ads-search-ctr", name=f"din-{a.date}", config=vars(a), job_type="daily-retrain")

    best_auc, step = 0.0, 0
    for epoch in range(a.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            *feats, y = [t.to(device, non_blocking=True) for t in batch]
            logits = model(*feats)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 500 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/logloss": avg.item(), "epoch": epoch}, step=step)

        auc, ll = evaluate(model.module, eval_dl, device)
        if rank == 0:
            wandb.log({"eval/auc": auc, "eval/logloss": ll}, step=step)
            print(f"[{a.date}] epoch {epoch} eval auc={auc:.5f} logloss={ll:.5f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "auc": auc, "epoch": epoch},
                           os.path.join(a.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        wandb.summary["best_eval_auc"] = best_auc
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
