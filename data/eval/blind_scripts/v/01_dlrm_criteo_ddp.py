"""
DLRM-style CTR model on Criteo 1TB (days 0-22 train, day 23 eval), preprocessed
offline into per-day numpy shards (dense_fp16.npy, sparse_i32.npy, labels_u8.npy).

Runs as a Kubeflow PyTorchJob (training-operator v1.7), 1 Master + 3 Workers,
8x A100-80G each. Container command:

    torchrun --nnodes=${PET_NNODES} --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=${MASTER_ADDR}:${MASTER_PORT} \
        --rdzv_id=${PET_RDZV_ID} \
        train_dlrm.py --data-dir /mnt/criteo/npy --batch-size 2048 \
        --run-name dlrm-criteo-v3 --ckpt-dir /mnt/ckpt/dlrm-criteo-v3

WANDB_API_KEY / WANDB_ENTITY are mounted from the `wandb-secret` k8s secret.
/mnt/ckpt is a ReadWriteMany PVC shared by all pods.
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC

# hashed cardinalities after frequency thresholding (min count 3)
CARDINALITIES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
    2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771,
    25641295, 39664984, 585935, 12972, 108, 36,
]
MAX_ROWS = 500_000  # cap per table, hashed modulo


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--train-days", type=str, default="0-22")
    p.add_argument("--eval-day", type=int, default=23)
    p.add_argument("--batch-size", type=int, default=2048, help="per GPU")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emb-lr", type=float, default=2e-2)
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--run-name", default="dlrm-criteo")
    p.add_argument("--ckpt-dir", default="/mnt/ckpt/dlrm")
    return p.parse_args()


class CriteoDays(Dataset):
    def __init__(self, root, days):
        self.dense, self.sparse, self.labels, self.offsets = [], [], [], [0]
        for d in days:
            base = os.path.join(root, f"day_{d}")
            self.dense.append(np.load(f"{base}/dense_fp16.npy", mmap_mode="r"))
            self.sparse.append(np.load(f"{base}/sparse_i32.npy", mmap_mode="r"))
            self.labels.append(np.load(f"{base}/labels_u8.npy", mmap_mode="r"))
            self.offsets.append(self.offsets[-1] + len(self.labels[-1]))

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, idx):
        day = np.searchsorted(self.offsets, idx, side="right") - 1
        i = idx - self.offsets[day]
        dense = torch.from_numpy(np.log1p(np.maximum(self.dense[day][i].astype(np.float32), 0.0)))
        sparse = torch.from_numpy(self.sparse[day][i].astype(np.int64))
        label = torch.tensor(float(self.labels[day][i]))
        return dense, sparse, label


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, emb_dim=64):
        super().__init__()
        self.rows = [min(c, MAX_ROWS) for c in CARDINALITIES]
        self.embs = nn.ModuleList([nn.Embedding(r, emb_dim) for r in self.rows])
        for e in self.embs:
            nn.init.uniform_(e.weight, -1.0 / math.sqrt(e.num_embeddings), 1.0 / math.sqrt(e.num_embeddings))
        self.bottom = mlp([13, 512, 256, emb_dim])
        n_f = len(self.embs) + 1
        self.n_inter = n_f * (n_f - 1) // 2
        self.top = mlp([self.n_inter + emb_dim, 1024, 1024, 512, 256, 1], last_act=False)
        iu = torch.triu_indices(n_f, n_f, offset=1)
        self.register_buffer("iu_r", iu[0], persistent=False)
        self.register_buffer("iu_c", iu[1], persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = [x] + [emb(sparse[:, i] % self.rows[i]) for i, emb in enumerate(self.embs)]
        t = torch.stack(feats, dim=1)                       # B, F, D
        z = torch.bmm(t, t.transpose(1, 2))[:, self.iu_r, self.iu_c]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def parse_days(s):
    a, b = s.split("-")
    return list(range(int(a), int(b) + 1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros(2, device=device)
    for dense, sparse, label in loader:
        dense, sparse, label = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), label.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(dense, sparse).float()
        loss_sum[0] += F.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        loss_sum[1] += label.numel()
        auroc.update(torch.sigmoid(logits), label.long())
    dist.all_reduce(loss_sum)
    auc = auroc.compute().item()
    model.train()
    return (loss_sum[0] / loss_sum[1]).item(), auc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    run = wandb.init(project="ranking-ctr", name=args.run_name, id=args.run_name,
                     resume="allow", config=vars(args))

    train_ds = CriteoDays(args.data_dir, parse_days(args.train_days))
    eval_ds = CriteoDays(args.data_dir, [args.eval_day])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    eval_loader = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=8192,
                             num_workers=args.num_workers, pin_memory=True)

    model = DLRM(args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    emb_params = [p for n, p in model.named_parameters() if "embs." in n]
    dense_params = [p for n, p in model.named_parameters() if "embs." not in n]
    opt = torch.optim.Adam([
        {"params": dense_params, "lr": args.lr},
        {"params": emb_params, "lr": args.emb_lr},
    ])
    base_lrs = [g["lr"] for g in opt.param_groups]

    step, start_epoch = 0, 0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, start_epoch = ckpt["step"], ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}")

    model.train()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, label in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)

            scale = min(1.0, (step + 1) / args.warmup_steps)
            for g, lr in zip(opt.param_groups, base_lrs):
                g["lr"] = lr * scale

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(dense, sparse)
            loss = F.binary_cross_entropy_with_logits(logits.float(), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % args.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                dt = time.time() - t0
                t0 = time.time()
                qps = args.batch_size * world * args.log_every / dt
                wandb.log({"train/loss": l.item(), "train/qps": qps, "lr": opt.param_groups[0]["lr"]}, step=step)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.5f} qps {qps:,.0f}")

            if step % args.eval_every == 0:
                val_loss, val_auc = evaluate(model.module, eval_loader, device)
                wandb.log({"eval/logloss": val_loss, "eval/auc": val_auc}, step=step)
                if rank == 0:
                    print(f"eval step {step}: logloss {val_loss:.5f} auc {val_auc:.5f}")

        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": step, "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    val_loss, val_auc = evaluate(model.module, eval_loader, device)
    wandb.log({"eval/logloss": val_loss, "eval/auc": val_auc}, step=step)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
