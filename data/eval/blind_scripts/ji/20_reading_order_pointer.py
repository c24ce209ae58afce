"""Reading-order prediction for OCR'd pages (ReadingBank-style data).

Every page comes as a set of OCR segments (text line + box) in arbitrary order; the model
predicts, for each segment, which segment is read next (pointer over the page, index 0 = END).

    torchrun --nproc_per_node=8 20_reading_order_pointer.py --train data/readingbank/train.jsonl \
        --dev data/readingbank/dev.jsonl
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

MAX_SEG = 96
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--text_encoder", default="microsoft/MiniLM-L12-H384-uncased")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--save_dir", default="checkpoints/reading_order")
    return p.parse_args()


class PageSegments(Dataset):
    """Line: {"segments": [{"text": ..., "box": [x0,y0,x1,y1] (0-1000)}, ...]} in gold reading order."""

    def __init__(self, path, tokenizer, fixed_shuffle=False):
        with open(path) as f:
            self.pages = [json.loads(l)["segments"][:MAX_SEG] for l in f]
        self.tok = tokenizer
        self.fixed_shuffle = fixed_shuffle

    def __len__(self):
        return len(self.pages)

    def __getitem__(self, i):
        segs = self.pages[i]
        order = list(range(len(segs)))
        rng = random.Random(i) if self.fixed_shuffle else random
        rng.shuffle(order)  # model input order; gold order = original index
        shown = [segs[k] for k in order]
        pos_of = {k: p for p, k in enumerate(order)}
        # successor target (1-based position in the shown order, 0 = end of page)
        succ = [pos_of[k + 1] + 1 if k + 1 < len(segs) else 0 for k in order]
        enc = self.tok([s["text"] for s in shown], truncation=True, max_length=24, padding="max_length",
                       return_tensors="pt")
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "boxes": torch.tensor([s["box"] for s in shown], dtype=torch.float) / 1000.0,
            "succ": torch.tensor(succ),
        }


def collate(items):
    n = max(it["succ"].numel() for it in items)
    b = len(items)
    L = items[0]["input_ids"].size(1)
    out = {
        "input_ids": torch.zeros(b, n, L, dtype=torch.long),
        "attention_mask": torch.zeros(b, n, L, dtype=torch.long),
        "boxes": torch.zeros(b, n, 4),
        "succ": torch.full((b, n), -100, dtype=torch.long),
        "n_seg": torch.tensor([it["succ"].numel() for it in items]),
    }
    for k, it in enumerate(items):
        m = it["succ"].numel()
        out["input_ids"][k, :m] = it["input_ids"]
        out["attention_mask"][k, :m] = it["attention_mask"]
        out["boxes"][k, :m] = it["boxes"]
        out["succ"][k, :m] = it["succ"]
    return out


def pointer_mask(n_seg, n_max):
    """(B, n_max, n_max + 1) mask of valid successor slots; slot 0 is END."""
    idx = torch.arange(n_max + 1, device=DEVICE)
    valid_slot = (idx[None, :] == 0) | (idx[None, :] <= n_seg.to(DEVICE)[:, None])
    self_slot = idx[None, None, :] == (torch.arange(n_max, device=DEVICE)[None, :, None] + 1)
    return valid_slot[:, None, :] & ~self_slot


class ReadingOrderNet(nn.Module):
    def __init__(self, text_encoder, layers, d=384):
        super().__init__()
        self.text = AutoModel.from_pretrained(text_encoder, add_pooling_layer=False)
        self.box = nn.Sequential(nn.Linear(6, d), nn.GELU(), nn.Linear(d, d))
        layer = nn.TransformerEncoderLayer(d, 6, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.page = nn.TransformerEncoder(layer, layers)
        self.end = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, input_ids, attention_mask, boxes, n_seg):
        b, n, L = input_ids.shape
        h = self.text(input_ids=input_ids.view(b * n, L), attention_mask=attention_mask.view(b * n, L)).last_hidden_state
        m = attention_mask.view(b * n, L, 1).float()
        seg = ((h * m).sum(1) / m.sum(1).clamp(min=1)).view(b, n, -1)
        wh = boxes[..., 2:] - boxes[..., :2]
        seg = seg + self.box(torch.cat([boxes, wh], -1))
        pad = torch.arange(n, device=seg.device)[None, :] >= n_seg[:, None]
        seg = self.page(seg, src_key_padding_mask=pad)
        keys = torch.cat([self.end.expand(b, -1, -1), seg], 1)
        logits = torch.einsum("bid,bjd->bij", self.q(seg), self.k(keys)) / seg.size(-1) ** 0.5
        return logits.masked_fill(~pointer_mask(n_seg, n), float("-inf"))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct successors, segments, fully correct pages
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["input_ids"], batch["attention_mask"], batch["boxes"], batch["n_seg"])
        valid = batch["succ"] != -100
        hit = (logits.argmax(-1) == batch["succ"]) & valid
        stats[0] += hit.sum()
        stats[1] += valid.sum()
        stats[2] += (hit.sum(1) == valid.sum(1)).sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), stats[2].item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.text_encoder)
    train_ds = PageSegments(args.train, tok)
    dev_ds = PageSegments(args.dev, tok, fixed_shuffle=True)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=6,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=args.bs,
                        collate_fn=collate, num_workers=4)

    model = ReadingOrderNet(args.text_encoder, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.05)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["boxes"], batch["n_seg"])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["succ"].flatten(), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        acc, perfect = evaluate(model.module, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: successor acc {acc:.4f}, perfectly ordered pages {int(perfect)}/{len(dev_ds)}",
                  flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
