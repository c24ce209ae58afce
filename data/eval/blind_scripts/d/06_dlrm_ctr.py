"""
Small DLRM for CTR prediction on preprocessed Criteo-Kaggle (day_*.npz with dense, sparse, label arrays).

    torchrun --nnodes=1 --nproc_per_node=4 06_dlrm_ctr.py --data-dir /data/criteo_kaggle_npz
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# Criteo Kaggle cardinalities after frequency thresholding (min count 3)
TABLE_SIZES = [1460, 583, 305686, 124083, 305, 24, 12517, 633, 3, 93145, 5683, 282506, 3194,
               27, 14992, 224152, 10, 5461, 2173, 4, 260000, 18, 15, 52981, 105, 38011]


class CriteoNpz(Dataset):
    def __init__(self, files):
        dense, sparse, label = [], [], []
        for f in files:
            d = np.load(f)
            dense.append(d["dense"]), sparse.append(d["sparse"]), label.append(d["label"])
        self.dense = torch.from_numpy(np.log1p(np.maximum(np.concatenate(dense), 0)).astype(np.float32))
        self.sparse = torch.from_numpy(np.concatenate(sparse).astype(np.int64))
        self.label = torch.from_numpy(np.concatenate(label).astype(np.float32))

    def __len__(self):
        return self.label.size(0)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i]


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, table_sizes, emb_dim=64, bottom=(13, 512, 256, 64), top=(1024, 1024, 512, 256, 1)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n, emb_dim) for n in table_sizes])
        for e in self.embs:
            nn.init.uniform_(e.weight, -(1.0 / e.num_embeddings) ** 0.5, (1.0 / e.num_embeddings) ** 0.5)
        self.bottom = mlp(list(bottom))
        n_feat = len(table_sizes) + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = mlp([n_inter + emb_dim] + list(top[1:]), last_act=False)
        self.register_buffer("tri_idx", torch.triu_indices(n_feat, n_feat, offset=1), persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        embs = [emb(sparse[:, i]) for i, emb in enumerate(self.embs)]
        feats = torch.stack([x] + embs, dim=1)                 # B x F x D
        inter = torch.bmm(feats, feats.transpose(1, 2))        # B x F x F
        inter = inter[:, self.tri_idx[0], self.tri_idx[1]]     # B x F(F-1)/2
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    loss_sum = torch.zeros(2, device=device)
    for dense, sparse, label in loader:
        dense, sparse, label = dense.to(device), sparse.to(device), label.to(device)
        logits = model(dense, sparse)
        loss_sum[0] += F.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        loss_sum[1] += label.numel()
        preds.append(torch.sigmoid(logits).cpu())
        labels.append(label.cpu())
    dist.all_reduce(loss_sum)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (torch.cat(preds).numpy(), torch.cat(labels).numpy()))
    all_p = np.concatenate([g[0] for g in gathered])
    all_y = np.concatenate([g[1] for g in gathered])
    model.train()
    return roc_auc_score(all_y, all_p), (loss_sum[0] / loss_sum[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--ckpt", default="checkpoints/dlrm.pt")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1)

    files = sorted(glob.glob(os.path.join(args.data_dir, "day_*.npz")))
    train_ds = CriteoNpz(files[:-1])
    val_ds = CriteoNpz(files[-1:])
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16384, sampler=val_sampler, num_workers=4)

    model = DLRM(TABLE_SIZES).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    # global batch is batch_size * world_size; scale lr with sqrt of the global batch vs 2048
    lr = args.lr * (args.batch_size * world_size / 2048) ** 0.5
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    step = 0
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for dense, sparse, label in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            logits = model(dense, sparse)
            loss = F.binary_cross_entropy_with_logits(logits, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.detach()
            step += 1

            if step % 200 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if rank == 0:
                    qps = 200 * args.batch_size * world_size / (time.time() - t0)
                    print(f"step {step} loss {running.item() / 200:.5f} {qps:,.0f} samples/s", flush=True)
                running.zero_()
                t0 = time.time()

            if step % args.eval_every == 0 and rank == 0:
                auc, val_loss = evaluate(model.module, val_loader, device)
                print(f"step {step} val AUC {auc:.5f} logloss {val_loss:.5f}", flush=True)
                if auc > best_auc:
                    best_auc = auc
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "step": step, "auc": auc}, args.ckpt)

    auc, val_loss = evaluate(model.module, val_loader, device)
    if rank == 0:
        print(f"final val AUC {auc:.5f} logloss {val_loss:.5f} (best {max(auc, best_auc):.5f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
