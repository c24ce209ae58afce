"""Fine-tune ESM-2 (35M / 150M / 650M) to regress melting temperature on the
FLIP Meltome "mixed_split" task.  Reports Spearman rho on validation every epoch and
on the test set with the best checkpoint at the end.

    torchrun --nproc_per_node=4 19_stability_finetune.py --csv data/flip_meltome_mixed_split.csv \
        --model facebook/esm2_t30_150M_UR50D --out runs/meltome_150M
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, EsmModel, get_linear_schedule_with_warmup


class Meltome(Dataset):
    def __init__(self, df, mean, std):
        self.seqs = df["sequence"].tolist()
        self.y = ((df["target"].values - mean) / std).astype(np.float32)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.y[i], i


class Collate:
    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def __call__(self, batch):
        seqs, ys, idx = zip(*batch)
        enc = self.tok(list(seqs), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor(ys), torch.tensor(idx)


class StabilityRegressor(nn.Module):
    def __init__(self, name, dropout=0.1):
        super().__init__()
        self.esm = EsmModel.from_pretrained(name, add_pooling_layer=False)
        self.esm.contact_head.requires_grad_(False)
        d = self.esm.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(d, d // 2), nn.GELU(), nn.Linear(d // 2, 1))

    def forward(self, ids, mask):
        h = self.esm(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        m[:, 0] = 0                                   # leave <cls> out of the mean
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return self.head(pooled).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    out = []
    for ids, mask, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = model(ids.to(device), mask.to(device)).float()
        out.append(np.stack([idx.numpy(), p.cpu().numpy(), y.numpy()], 1))
    model.train()
    local = np.concatenate(out) if out else np.zeros((0, 3))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    allp = np.concatenate(parts)
    return spearmanr(allp[:, 1], allp[:, 2]).correlation, allp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--model", default="facebook/esm2_t30_150M_UR50D")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.csv)
    train_df = df[(df.set == "train") & (~df.validation.fillna(False).astype(bool))]
    valid_df = df[(df.set == "train") & (df.validation.fillna(False).astype(bool))]
    test_df = df[df.set == "test"]
    mean, std = train_df.target.mean(), train_df.target.std()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    collate = Collate(tokenizer, args.max_len)
    train_ds, valid_ds, test_ds = Meltome(train_df, mean, std), Meltome(valid_df, mean, std), Meltome(test_df, mean, std)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    shard = lambda ds: Subset(ds, range(rank, len(ds), world))
    valid_loader = DataLoader(shard(valid_ds), batch_size=16, collate_fn=collate, num_workers=2)
    test_loader = DataLoader(shard(test_ds), batch_size=16, collate_fn=collate, num_workers=2)

    model = StabilityRegressor(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": [p for p in model.module.esm.parameters() if p.requires_grad], "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    loss_fn = nn.MSELoss()

    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_rho = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=device)
        for ids, mask, y, _ in train_loader:
            ids, mask, y = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(ids, mask)
            loss = loss_fn(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(run)

        rho, _ = predict(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train mse {(run[0] / run[1]).item():.4f} valid spearman {rho:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if rho > best_rho:
                best_rho = rho
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # test with the best validation checkpoint
    best_model = StabilityRegressor(args.model).to(device)
    best_model.load_state_dict(torch.load(best_path, map_location=device))
    test_rho, preds = predict(best_model, test_loader, device)
    if rank == 0:
        print(f"TEST spearman {test_rho:.4f} (best valid {best_rho:.4f})", flush=True)
        preds = preds[np.argsort(preds[:, 0])]
        pd.DataFrame({"sequence": test_df.sequence.values[preds[:, 0].astype(int)],
                      "pred_tm": preds[:, 1] * std + mean, "true_tm": preds[:, 2] * std + mean}
                     ).to_csv(os.path.join(args.out, "test_predictions.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
