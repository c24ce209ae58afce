"""One Optuna trial per launch: FT-Transformer on the marketing-response table, DDP over the node's GPUs.

The study lives in Postgres; a cron job starts this script repeatedly:
    torchrun --standalone --nproc_per_node=8 19_optuna_trial_ftt_ddp.py \
        --study ftt_response --storage postgresql://optuna@db/optuna --data /data/response
"""
import argparse
import os
import time

import numpy as np
import optuna
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from rtdl_revisiting_models import FTTransformer
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TARGET = "responded"
TE_COLS = ["postcode_district", "employer_sector", "referrer"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", required=True)
    ap.add_argument("--storage", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/shared/runs/ftt_response")
    return ap.parse_args()


def suggest(trial):
    return {
        "n_blocks": trial.suggest_int("n_blocks", 1, 4),
        "d_block": trial.suggest_categorical("d_block", [96, 128, 192, 256]),
        "attention_dropout": trial.suggest_float("attention_dropout", 0.0, 0.4),
        "ffn_dropout": trial.suggest_float("ffn_dropout", 0.0, 0.4),
        "lr": trial.suggest_float("lr", 1e-5, 1e-3, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-3, log=True),
        "te_smoothing": trial.suggest_float("te_smoothing", 1.0, 100.0, log=True),
    }


def oof_target_encoding(tr, va, cols, smoothing, seed):
    prior = tr[TARGET].mean()
    out_tr = np.zeros((len(tr), len(cols)), dtype=np.float32)
    out_va = np.zeros((len(va), len(cols)), dtype=np.float32)
    skf = StratifiedKFold(n_splits=5, shuffle=True, random_state=seed)
    for j, c in enumerate(cols):
        for fit, app in skf.split(tr, tr[TARGET]):
            g = tr.iloc[fit].groupby(c)[TARGET].agg(["sum", "count"])
            m = (g["sum"] + smoothing * prior) / (g["count"] + smoothing)
            out_tr[app, j] = tr.iloc[app][c].map(m).fillna(prior).values
        g = tr.groupby(c)[TARGET].agg(["sum", "count"])
        m = (g["sum"] + smoothing * prior) / (g["count"] + smoothing)
        out_va[:, j] = va[c].map(m).fillna(prior).values
    return out_tr, out_va


def build_data(args, hp):
    tr = pd.read_parquet(os.path.join(args.data, "train.parquet"))
    va = pd.read_parquet(os.path.join(args.data, "val.parquet"))
    cat_cols = [c for c in tr.columns if tr[c].dtype == object and c not in TE_COLS]
    num_cols = [c for c in tr.columns if c not in cat_cols + TE_COLS + [TARGET]]
    te_tr, te_va = oof_target_encoding(tr, va, TE_COLS, hp["te_smoothing"], args.seed)
    med = tr[num_cols].median()
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, subsample=10**9, random_state=args.seed)
    xn_tr = np.hstack([qt.fit_transform(tr[num_cols].fillna(med).values), te_tr]).astype(np.float32)
    xn_va = np.hstack([qt.transform(va[num_cols].fillna(med).values), te_va]).astype(np.float32)
    cards, xc_tr, xc_va = [], [], []
    for c in cat_cols:
        vocab = pd.Index(np.sort(tr[c].astype(str).unique()))
        cards.append(len(vocab) + 1)
        xc_tr.append(vocab.get_indexer(tr[c].astype(str)) + 1)
        xc_va.append(vocab.get_indexer(va[c].astype(str)) + 1)
    mk = lambda xn, xc, y: TensorDataset(torch.from_numpy(xn), torch.from_numpy(np.stack(xc, 1).astype(np.int64)),
                                         torch.from_numpy(y.astype(np.float32)))
    return mk(xn_tr, xc_tr, tr[TARGET].values), mk(xn_va, xc_va, va[TARGET].values), xn_tr.shape[1], cards


@torch.no_grad()
def val_auc(net, ds, rank, world, device):
    net.eval()
    xn, xc, y = ds.tensors
    sel = torch.arange(rank, len(y), world)
    s = torch.cat([torch.sigmoid(net(xn[sel[i:i + 8192]].to(device), xc[sel[i:i + 8192]].to(device)).squeeze(-1)).cpu()
                   for i in range(0, len(sel), 8192)])
    parts = [None] * world
    dist.all_gather_object(parts, (sel, s))
    idx = torch.cat([p[0] for p in parts])
    s = torch.cat([p[1] for p in parts])
    return roc_auc_score(y[idx].numpy(), s.numpy())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # rank 0 talks to the study; the sampled hyper-parameters are shared with the other ranks
    study = trial = None
    payload = [None]
    if rank == 0:
        study = optuna.load_study(study_name=args.study, storage=args.storage)
        trial = study.ask()
        payload[0] = {"number": trial.number, "hp": suggest(trial)}
    dist.broadcast_object_list(payload, src=0)
    trial_no, hp = payload[0]["number"], payload[0]["hp"]
    seed = args.seed + trial_no
    torch.manual_seed(seed)

    train_ds, val_ds, n_cont, cards = build_data(args, hp)
    kw = FTTransformer.get_default_kwargs(n_blocks=hp["n_blocks"])
    kw.update(d_block=hp["d_block"], attention_dropout=hp["attention_dropout"], ffn_dropout=hp["ffn_dropout"])
    net = FTTransformer(n_cont_features=n_cont, cat_cardinalities=cards, d_out=1, **kw).to(device)
    param_groups = net.make_parameter_groups()
    model = DDP(net, device_ids=[local_rank])

    # hp["lr"] is searched for a global batch of 512 -> linear scaling to the actual global batch
    lr = hp["lr"] * args.global_batch / 512
    opt = torch.optim.AdamW(param_groups, lr=lr, weight_decay=hp["weight_decay"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    warmup = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    pos = float(train_ds.tensors[2].mean())
    pos_weight = torch.tensor((1 - pos) / pos, device=device)
    run_dir = os.path.join(args.out, f"trial_{trial_no:04d}")
    run = None
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        run = wandb.init(project="ftt-response-sweep", name=f"trial_{trial_no}", config={**hp, "lr_scaled": lr,
                         "world_size": world, "global_batch": args.global_batch}, dir=run_dir)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc).squeeze(-1), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        auc = val_auc(net, val_ds, rank, world, device)

        prune = torch.zeros(1, device=device)
        if rank == 0:
            run.log({"val/auc": auc, "epoch": epoch, "epoch_time": time.time() - t0})
            trial.report(auc, epoch)
            if auc > best:
                best = auc
                torch.save({"model": net.state_dict(), "hp": hp, "cards": cards}, os.path.join(run_dir, "best.pt"))
            prune[0] = float(trial.should_prune())
        dist.broadcast(prune, src=0)
        if prune.item():
            break

    if rank == 0:
        if prune.item():
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, best)
        run.summary["best_val_auc"] = best
        run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
