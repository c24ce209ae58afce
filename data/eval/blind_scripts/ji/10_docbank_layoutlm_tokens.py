"""Token-level layout labelling on DocBank (paragraph / title / equation / table / ...) with LayoutLM.

DocBank txt annotation format, one token per line:
    token  x0  y0  x1  y1  R  G  B  font_name  label       (coordinates already in 0..1000)

    torchrun --nproc_per_node=8 10_docbank_layoutlm_tokens.py --root /data/DocBank --max_pages 100000
"""
import argparse
import glob
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertTokenizerFast, LayoutLMForTokenClassification, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="microsoft/layoutlm-base-uncased")
    ap.add_argument("--max_pages", type=int, default=100_000)
    ap.add_argument("--val_pages", type=int, default=5_000)
    ap.add_argument("--window", type=int, default=510)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save", default="checkpoints/docbank_layoutlm.pt")
    return ap.parse_args()


def read_page(path):
    words, boxes, labels = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 10 or not parts[0].strip():
                continue
            words.append(parts[0])
            boxes.append([min(1000, max(0, int(v))) for v in parts[1:5]])
            labels.append(parts[9])
    return words, boxes, labels


class DocBankWindows(Dataset):
    """Tokenizes lazily; each item is one page cut to the first `window` subword tokens."""

    def __init__(self, files, tokenizer, label2id, window):
        self.files = files
        self.tok = tokenizer
        self.label2id = label2id
        self.window = window

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        words, boxes, labels = read_page(self.files[i])
        enc = self.tok(words, is_split_into_words=True, truncation=True, max_length=self.window + 2,
                       padding="max_length")
        bbox, tags, prev = [], [], None
        for wid in enc.word_ids():
            if wid is None:
                bbox.append([0, 0, 0, 0] if len(bbox) == 0 else [1000, 1000, 1000, 1000])
                tags.append(-100)
            else:
                bbox.append(boxes[wid])
                tags.append(self.label2id[labels[wid]] if wid != prev else -100)
            prev = wid
        return {
            "input_ids": torch.tensor(enc["input_ids"]),
            "attention_mask": torch.tensor(enc["attention_mask"]),
            "token_type_ids": torch.tensor(enc["token_type_ids"]),
            "bbox": torch.tensor(bbox),
            "labels": torch.tensor(tags),
        }


def collect_labels(files, n_probe=2000):
    seen = set()
    for path in files[:n_probe]:
        seen.update(read_page(path)[2])
    return list(seen)


@torch.no_grad()
def evaluate(model, loader, n_labels, device):
    model.eval()
    conf = torch.zeros(n_labels, n_labels, dtype=torch.long, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        keep = batch["labels"] != -100
        gold = batch["labels"][keep]
        pred = logits.argmax(-1)[keep]
        conf += torch.bincount(gold * n_labels + pred, minlength=n_labels * n_labels).view(n_labels, n_labels)
    dist.all_reduce(conf)
    tp = conf.diag().float()
    prec = tp / conf.sum(0).clamp(min=1)
    rec = tp / conf.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-9)
    model.train()
    return f1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    files = sorted(glob.glob(os.path.join(args.root, "DocBank_500K_txt", "*.txt")))
    random.Random(1234).shuffle(files)
    files = files[: args.max_pages + args.val_pages]
    val_files, train_files = files[: args.val_pages], files[args.val_pages:]

    label_list = collect_labels(train_files)
    label2id = {l: i for i, l in enumerate(label_list)}
    if rank == 0:
        print(f"{len(train_files)} train pages, {len(val_files)} val pages, labels: {label_list}", flush=True)

    tokenizer = BertTokenizerFast.from_pretrained(args.model)
    train_ds = DocBankWindows(train_files, tokenizer, label2id, args.window)
    val_ds = DocBankWindows(val_files, tokenizer, label2id, args.window)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs,
                        num_workers=args.workers, pin_memory=True)

    model = LayoutLMForTokenClassification.from_pretrained(args.model, num_labels=len(label_list))
    # LayoutLMModel computes a pooled output that the token head ignores
    model = DDP(model.to(device), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 20, total)
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                rate = step / (time.time() - t0 + 1e-9) if epoch == 0 else 0.0
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} ({rate:.1f} it/s)", flush=True)
            if step % 5000 == 0 or step == total:
                f1 = evaluate(model.module, val_dl, len(label_list), device)
                if rank == 0:
                    report = "  ".join(f"{l}={f1[i].item():.3f}" for i, l in enumerate(label_list))
                    print(f"[eval step {step}] macro-F1 {f1.mean().item():.4f}  {report}", flush=True)
                    os.makedirs(os.path.dirname(args.save), exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "labels": label_list, "step": step}, args.save)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
