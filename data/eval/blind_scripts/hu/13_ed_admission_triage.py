"""ED disposition model: predict hospital admission at triage.

Inputs: triage vitals, acuity, arrival mode, age/sex, prior-year utilization counts, and the
free-text chief complaint (wordpiece ids, bag-of-embeddings).  Patient-level splits were made
upstream (no patient in more than one split); the held-out test set is a later time period.

    torchrun --standalone --nproc_per_node=4 13_ed_admission_triage.py --data_dir /data/ed_triage
"""
import argparse
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, brier_score_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer

NUMERIC = ["age", "temp", "heartrate", "resprate", "o2sat", "sbp", "dbp", "pain", "acuity",
           "n_ed_visits_1y", "n_admissions_1y", "n_icu_1y"]
CATEG = ["gender", "arrival_transport"]

logger = logging.getLogger("ed")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--tokenizer", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--ckpt_dir", default="checkpoints/ed_admit")
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("--emb", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--bs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=12)
    return ap.parse_args()


class TriageData(Dataset):
    def __init__(self, df, tok, max_tokens, stats, cat_maps):
        num = df[NUMERIC].astype("float32")
        self.num = ((num - stats["mean"]) / stats["std"]).fillna(0.0).values.astype(np.float32)
        self.miss = num.isna().values.astype(np.float32)
        self.cat = np.stack([df[c].map(cat_maps[c]).fillna(0).astype(int).values for c in CATEG], 1)
        enc = tok(df.chiefcomplaint.fillna("").str.lower().tolist(), max_length=max_tokens,
                  truncation=True, padding="max_length", add_special_tokens=False)
        self.tokens = np.asarray(enc["input_ids"], dtype=np.int64)
        self.y = df.admitted.values.astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (torch.from_numpy(np.concatenate([self.num[i], self.miss[i]])), torch.from_numpy(self.cat[i]),
                torch.from_numpy(self.tokens[i]), torch.tensor(self.y[i]))


class TriageNet(nn.Module):
    def __init__(self, n_num, cat_sizes, vocab, emb, hidden, pad_id):
        super().__init__()
        self.cats = nn.ModuleList(nn.Embedding(n + 1, 8) for n in cat_sizes)
        self.words = nn.EmbeddingBag(vocab, emb, mode="mean", padding_idx=pad_id)
        d = 2 * n_num + 8 * len(cat_sizes) + emb
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, 1))

    def forward(self, num, cat, tokens):
        c = torch.cat([e(cat[:, k]) for k, e in enumerate(self.cats)], dim=1)
        return self.mlp(torch.cat([num, c, self.words(tokens)], dim=1)).squeeze(1)


@torch.no_grad()
def collect_probs(model, ds, device):
    """Unpadded strided shard per rank, gathered as Python objects (sizes can differ)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    idx = list(range(rank, len(ds), world))
    dl = DataLoader(torch.utils.data.Subset(ds, idx), batch_size=4096, num_workers=2)
    model.eval()
    out = []
    for num, cat, tok, _ in dl:
        out.append(torch.sigmoid(model(num.to(device), cat.to(device), tok.to(device))).cpu())
    local = (idx, torch.cat(out).numpy() if out else np.zeros(0))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    p = np.zeros(len(ds), dtype=np.float32)
    for ids, vals in parts:
        p[ids] = vals
    return p


def report(name, y, p):
    return (f"{name}: AUROC {roc_auc_score(y, p):.4f} AUPRC {average_precision_score(y, p):.4f} "
            f"Brier {brier_score_loss(y, p):.4f}")


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    frames = {s: pd.read_parquet(os.path.join(args.data_dir, f"{s}.parquet")) for s in ("train", "val", "test")}
    tr = frames["train"]
    stats = {"mean": tr[NUMERIC].astype("float32").mean(), "std": tr[NUMERIC].astype("float32").std()}
    cat_maps = {c: {v: i + 1 for i, v in enumerate(sorted(tr[c].dropna().unique()))} for c in CATEG}
    data = {s: TriageData(f, tok, args.max_tokens, stats, cat_maps) for s, f in frames.items()}
    logger.info("visits: %s", {s: len(d) for s, d in data.items()})

    sampler = DistributedSampler(data["train"], shuffle=True)
    loader = DataLoader(data["train"], batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)

    def build_model():
        return TriageNet(len(NUMERIC), [len(cat_maps[c]) for c in CATEG], tok.vocab_size,
                         args.emb, args.hidden, tok.pad_token_id)

    model = DDP(build_model().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_path = os.path.join(args.ckpt_dir, "best.pt")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        s = torch.zeros(2, device=device)
        for num, cat, tokens, y in loader:
            num, cat, tokens, y = (t.to(device, non_blocking=True) for t in (num, cat, tokens, y))
            loss = F.binary_cross_entropy_with_logits(model(num, cat, tokens), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        sched.step()
        dist.all_reduce(s)

        p_val = collect_probs(model.module, data["val"], device)
        if rank == 0:
            auc = roc_auc_score(data["val"].y, p_val)
            logger.info("epoch %d train_bce %.4f | %s", epoch, (s[0] / s[1]).item(),
                        report("val", data["val"].y, p_val))
            if auc > best:
                best = auc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # final evaluation of the selected model on the temporally held-out test period
    if rank == 0:
        final = build_model().to(device)
        final.load_state_dict(torch.load(best_path, map_location=device))
        final.eval()
        dl = DataLoader(data["test"], batch_size=4096, num_workers=2)
        with torch.no_grad():
            p_test = torch.cat([torch.sigmoid(final(n.to(device), c.to(device), t.to(device))).cpu()
                                for n, c, t, _ in dl]).numpy()
        logger.info(report("test", data["test"].y, p_test))
        np.save(os.path.join(args.ckpt_dir, "test_probs.npy"), p_test)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
