"""
Temporal relation (TLINK) classification between EVENT / TIMEX3 pairs in discharge summaries
(i2b2-2012: BEFORE / AFTER / OVERLAP). Trains with DDP, keeps the best dev checkpoint, then scores the
test set with that checkpoint and writes predictions for the i2b2 evaluation script.

    torchrun --nproc_per_node=4 20_re_temporal_export.py --data data/i2b2_2012_tlink --out runs/tlink
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

TLINKS = ["BEFORE", "AFTER", "OVERLAP"]
ARG_TYPES = ["EVENT", "TIMEX3", "SECTIME"]


class TlinkPairs(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        for line in open(path):
            ex = json.loads(line)
            enc = tok(ex["text"], truncation=True, max_length=max_len, return_offsets_mapping=True)
            s1 = next((i for i, (a, b) in enumerate(enc["offset_mapping"]) if a <= ex["arg1"][0] < b), 0)
            s2 = next((i for i, (a, b) in enumerate(enc["offset_mapping"]) if a <= ex["arg2"][0] < b), 0)
            self.items.append({"ids": enc["input_ids"], "s1": s1, "s2": s2,
                               "t1": ARG_TYPES.index(ex["arg1_type"]), "t2": ARG_TYPES.index(ex["arg2_type"]),
                               "y": TLINKS.index(ex["label"]) if ex.get("label") else -1,
                               "pair_id": ex["pair_id"]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch, pad_id):
    L = max(len(b["ids"]) for b in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, : len(b["ids"])] = torch.tensor(b["ids"])
    t = lambda k: torch.tensor([b[k] for b in batch])
    return {"ids": ids, "mask": (ids != pad_id).long(), "s1": t("s1"), "s2": t("s2"), "t1": t("t1"),
            "t2": t("t2"), "y": t("y"), "pair_id": [b["pair_id"] for b in batch]}


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


class TlinkModel(nn.Module):
    def __init__(self, name, n_types=len(ARG_TYPES), n_rel=len(TLINKS)):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.type_emb = nn.Embedding(n_types, 32)
        self.mlp = nn.Sequential(nn.Linear(2 * (h + 32), h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, n_rel))

    def forward(self, ids, mask, s1, s2, t1, t2):
        h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
        r = torch.arange(h.size(0), device=h.device)
        a1 = torch.cat([h[r, s1], self.type_emb(t1)], -1)
        a2 = torch.cat([h[r, s2], self.type_emb(t2)], -1)
        return self.mlp(torch.cat([a1, a2], -1))


def run(model, batch, device):
    return model(*(batch[k].to(device, non_blocking=True) for k in ("ids", "mask", "s1", "s2", "t1", "t2")))


@torch.no_grad()
def dev_accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for batch in loader:
        pred = run(model, batch, device).argmax(-1)
        c[0] += (pred == batch["y"].to(device)).sum()
        c[1] += pred.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--label_smoothing", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=2012)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    train = TlinkPairs(os.path.join(args.data, "train.jsonl"), tok, args.max_len)
    dev = TlinkPairs(os.path.join(args.data, "dev.jsonl"), tok, args.max_len)
    coll = Collator(tok.pad_token_id)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=coll, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev, range(rank, len(dev), world)), batch_size=64, collate_fn=coll, num_workers=2)

    model = DDP(TlinkModel(args.encoder).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    best_path = os.path.join(args.out, "tlink_best.pt")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_dl:
            logits = run(model, batch, device)
            loss = F.cross_entropy(logits, batch["y"].to(device), label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        acc = dev_accuracy(model.module, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: dev accuracy {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # test-set predictions from the best checkpoint (single process, small set)
    if rank == 0:
        test = TlinkPairs(os.path.join(args.data, "test.jsonl"), tok, args.max_len)
        test_dl = DataLoader(test, batch_size=64, collate_fn=coll)
        final = TlinkModel(args.encoder).to(device)
        final.load_state_dict(torch.load(best_path, map_location=device))
        final.eval()
        preds = {}
        with torch.no_grad():
            for batch in test_dl:
                for pid, p in zip(batch["pair_id"], run(final, batch, device).argmax(-1).tolist()):
                    preds[pid] = TLINKS[p]
        with open(os.path.join(args.out, "test_tlinks.json"), "w") as f:
            json.dump(preds, f)
        print(f"wrote {len(preds)} test TLINK predictions (best dev acc {best:.4f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
