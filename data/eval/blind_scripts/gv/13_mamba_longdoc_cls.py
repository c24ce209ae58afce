"""
Long-document classification (arXiv subject classes, up to 16k tokens) with a pretrained
Mamba backbone and a mean-pooled linear head.

    torchrun --nproc_per_node=4 13_mamba_longdoc_cls.py --data_dir data/arxiv_cls --max_len 16384
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer

from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel


class LongDocDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, label2id):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.max_len = max_len
        self.label2id = label2id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids = self.tok(r["text"], truncation=True, max_length=self.max_len,
                       add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long), self.label2id[r["label"]]


def collate(batch, pad_id):
    lens = torch.tensor([len(x) for x, _ in batch])
    ids = torch.full((len(batch), int(lens.max())), pad_id, dtype=torch.long)
    for i, (x, _) in enumerate(batch):
        ids[i, : len(x)] = x  # right padding: the causal scan never sees pads before real tokens
    labels = torch.tensor([y for _, y in batch])
    return ids, lens, labels


class MambaClassifier(nn.Module):
    def __init__(self, pretrained, n_classes, dropout=0.1):
        super().__init__()
        lm = MambaLMHeadModel.from_pretrained(pretrained, dtype=torch.float32)
        self.backbone = lm.backbone
        d = lm.config.d_model
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(d, n_classes)

    def forward(self, ids, lens):
        h = self.backbone(ids)  # (B, L, D)
        mask = (torch.arange(h.size(1), device=h.device)[None] < lens[:, None]).unsqueeze(-1)
        pooled = (h * mask).sum(1) / lens[:, None].to(h.dtype)
        return self.head(self.dropout(pooled))


@torch.no_grad()
def run_eval(model, loader, device, distributed=True):
    model.eval()
    c = torch.zeros(3, device=device, dtype=torch.float64)
    for ids, lens, y in loader:
        ids, lens, y = ids.to(device), lens.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, lens)
        c[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        c[1] += (logits.argmax(-1) == y).sum()
        c[2] += y.numel()
    if distributed:
        dist.all_reduce(c)
    model.train()
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/arxiv_cls")
    ap.add_argument("--pretrained", default="state-spaces/mamba-370m")
    ap.add_argument("--tokenizer", default="EleutherAI/gpt-neox-20b")
    ap.add_argument("--max_len", type=int, default=16384)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--out", default="out/mamba_arxiv_cls")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(os.path.join(args.data_dir, "labels.json")) as f:
        label_names = json.load(f)  # fixed, sorted list shipped with the data
    label2id = {n: i for i, n in enumerate(label_names)}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    col = functools.partial(collate, pad_id=pad)

    train_ds = LongDocDataset(os.path.join(args.data_dir, "train.jsonl"), tok, args.max_len, label2id)
    val_ds = LongDocDataset(os.path.join(args.data_dir, "val.jsonl"), tok, args.max_len, label2id)
    test_ds = LongDocDataset(os.path.join(args.data_dir, "test.jsonl"), tok, args.max_len, label2id)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=tr_sampler,
                          collate_fn=col, num_workers=4, drop_last=True)
    val_sub = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    val_dl = DataLoader(val_sub, batch_size=args.batch_size, collate_fn=col, num_workers=2)

    model = MambaClassifier(args.pretrained, len(label_names)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": model.module.backbone.parameters(), "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, args.head_lr], total_steps=total,
                                                pct_start=0.06, anneal_strategy="linear")

    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for ids, lens, y in train_dl:
            ids, lens, y = ids.to(device), lens.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, lens)
            loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        val_loss, val_acc = run_eval(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} train_loss {(tot[0] / tot[1]).item():.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # test with the best weights, in a fresh copy of the classifier
    del model, opt
    torch.cuda.empty_cache()
    final = MambaClassifier(args.pretrained, len(label_names)).to(device)
    final.load_state_dict(torch.load(best_path, map_location=device))
    test_sub = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    test_dl = DataLoader(test_sub, batch_size=args.batch_size, collate_fn=col, num_workers=2)
    test_loss, test_acc = run_eval(final, test_dl, device)
    if rank == 0:
        print(f"best val_acc {best_acc:.4f} | test_loss {test_loss:.4f} test_acc {test_acc:.4f}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"best_val_acc": best_acc, "test_acc": test_acc}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
