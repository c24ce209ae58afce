"""rtdl FT-Transformer on the loan-application table, on the preemptible queue.

Writes a full checkpoint (model, optimizer, scheduler, sampler epoch) every --ckpt-every steps
and resumes from it automatically after preemption.

torchrun --nproc_per_node=8 09_rtdl_ftt_loans_preemptible.py --data-dir /shared/loans \
    --out /shared/runs/ftt_loans --resume auto
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import rtdl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default="auto", help="'auto', 'none' or a path")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def load_split(path, cat_cols, num_cols, vocabs, qt, medians):
    df = pd.read_parquet(path)
    xc = np.stack([df[c].astype(str).map(vocabs[c]).fillna(0).astype(np.int64).values for c in cat_cols], 1)
    xn = qt.transform(df[num_cols].fillna(medians).values).astype(np.float32)
    return TensorDataset(torch.from_numpy(xn), torch.from_numpy(xc), torch.tensor(df["default"].values, dtype=torch.float32))


def prepare(args):
    tr = pd.read_parquet(os.path.join(args.data_dir, "train.parquet"))
    cat_cols = [c for c in tr.columns if tr[c].dtype == object]
    num_cols = [c for c in tr.columns if c not in cat_cols and c != "default"]
    vocabs = {}
    for c in cat_cols:
        vals = sorted(tr[c].astype(str).unique())
        vocabs[c] = {v: i + 1 for i, v in enumerate(vals)}
    medians = tr[num_cols].median()
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, subsample=10**9, random_state=0)
    qt.fit(tr[num_cols].fillna(medians).values)
    del tr
    train_ds = load_split(os.path.join(args.data_dir, "train.parquet"), cat_cols, num_cols, vocabs, qt, medians)
    val_ds = load_split(os.path.join(args.data_dir, "val.parquet"), cat_cols, num_cols, vocabs, qt, medians)
    cards = [len(vocabs[c]) + 1 for c in cat_cols]
    return train_ds, val_ds, len(num_cols), cards


def latest_checkpoint(out):
    ckpts = sorted(glob.glob(os.path.join(out, "step_*.pt")), key=lambda p: int(p.split("_")[-1][:-3]))
    return ckpts[-1] if ckpts else None


def save_checkpoint(out, step, epoch, model, opt, sched, best_auc):
    path = os.path.join(out, f"step_{step:08d}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "epoch": epoch, "best_auc": best_auc}, path + ".partial")
    os.replace(path + ".partial", path)
    for old in sorted(glob.glob(os.path.join(out, "step_*.pt")))[:-3]:
        os.remove(old)


@torch.no_grad()
def evaluate(model, ds, rank, world, device):
    model.eval()
    xn, xc, y = ds.tensors
    idx = torch.arange(rank, len(y), world)
    s = []
    for i in range(0, len(idx), 8192):
        j = idx[i:i + 8192]
        s.append(torch.sigmoid(model(xn[j].to(device), xc[j].to(device)).squeeze(-1)).float().cpu())
    parts = [None] * world
    dist.all_gather_object(parts, (idx, torch.cat(s)))
    order = torch.cat([p[0] for p in parts])
    scores = torch.cat([p[1] for p in parts])
    return roc_auc_score(y[order].numpy(), scores.numpy())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, n_num, cards = prepare(args)
    net = rtdl.FTTransformer.make_default(n_num_features=n_num, cat_cardinalities=cards,
                                          last_layer_query_idx=[-1], d_out=1).to(device)
    opt = torch.optim.AdamW(net.optimization_param_groups(), lr=args.lr, weight_decay=1e-5)
    model = DDP(net, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / total_steps))

    step, start_epoch, best_auc = 0, 0, 0.0
    path = latest_checkpoint(args.out) if args.resume == "auto" else (None if args.resume == "none" else args.resume)
    if path is not None:
        ckpt = torch.load(path)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step, start_epoch, best_auc = ckpt["step"], ckpt["epoch"], ckpt["best_auc"]
        if rank == 0:
            print(f"resumed from {path} (step {step}, epoch {start_epoch})", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    skip = step - start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (xn, xc, y) in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc).squeeze(-1), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save_checkpoint(args.out, step, epoch, model, opt, sched, best_auc)
                dist.barrier()

        auc = evaluate(net, val_ds, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} step {step} val_auc {auc:.5f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(net.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
