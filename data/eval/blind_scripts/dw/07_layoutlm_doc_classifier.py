"""Document-type classifier (16 RVL-CDIP classes + 'other') on LayoutLM text+layout.

OCR is done upstream (Azure Read export converted to our page JSON); this script only
consumes words + word boxes already normalised to the 0-1000 grid.

    torchrun --nproc_per_node=4 07_layoutlm_doc_classifier.py \
        --train pages/train.jsonl --dev pages/dev.jsonl --test pages/test.jsonl --workdir runs/doccls_lmv1
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMForSequenceClassification, LayoutLMTokenizerFast, get_linear_schedule_with_warmup

CLASSES = [
    "letter", "form", "email", "handwritten", "advertisement", "scientific_report",
    "scientific_publication", "specification", "file_folder", "news_article", "budget",
    "invoice", "presentation", "questionnaire", "resume", "memo", "other",
]

log = logging.getLogger("doccls")


class PageJsonl(Dataset):
    def __init__(self, path, tokenizer, max_len=512):
        self.rows = []
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                if r["words"]:
                    self.rows.append(r)
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["words"], boxes=r["boxes"], truncation=True, max_length=self.max_len,
                       padding="max_length", return_tensors="pt")
        item = {k: v[0] for k, v in enc.items()}
        item["labels"] = torch.tensor(CLASSES.index(r["doc_type"]))
        return item


def shard(ds, rank, world):
    return Subset(ds, list(range(rank, len(ds), world)))


@torch.no_grad()
def accuracy(net, loader, device):
    """Returns a GPU tensor [correct, total, loss_sum] for this rank's shard."""
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = net(**{k: v for k, v in batch.items() if k != "labels"}).logits
        acc[0] += (logits.argmax(-1) == batch["labels"]).sum()
        acc[1] += batch["labels"].numel()
        acc[2] += F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
    net.train()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--base", default="microsoft/layoutlm-base-uncased")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--bsz", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = LayoutLMTokenizerFast.from_pretrained(args.base)
    train_ds = PageJsonl(args.train, tokenizer)
    dev_ds = PageJsonl(args.dev, tokenizer)
    test_ds = PageJsonl(args.test, tokenizer)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(shard(dev_ds, rank, world), batch_size=64, num_workers=4)
    test_dl = DataLoader(shard(test_ds, rank, world), batch_size=64, num_workers=4)

    model = LayoutLMForSequenceClassification.from_pretrained(
        args.base, num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total), total)

    os.makedirs(args.workdir, exist_ok=True)
    best_path = os.path.join(args.workdir, "best_model.pt")
    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                log.info("ep %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        stats = accuracy(model.module, dev_dl, device)
        dist.all_reduce(stats)
        dev_acc = (stats[0] / stats[1]).item()
        if rank == 0:
            log.info("ep %d dev acc %.4f dev loss %.4f (%.1f min)", epoch, dev_acc,
                     (stats[2] / stats[1]).item(), (time.time() - t0) / 60)
            if dev_acc > best_acc:
                best_acc = dev_acc
                torch.save(model.state_dict(), best_path)
                log.info("new best -> %s", best_path)
        dist.barrier()

    # final: reload the best weights into a plain model, score test, export HF format
    best = LayoutLMForSequenceClassification.from_pretrained(
        args.base, num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)},
    )
    best.load_state_dict(torch.load(best_path, map_location="cpu"))
    best.to(device)
    stats = accuracy(best, test_dl, device)
    dist.all_reduce(stats)
    if rank == 0:
        log.info("test acc %.4f (n=%d), best dev acc %.4f", (stats[0] / stats[1]).item(), int(stats[1].item()),
                 best_acc)
        best.save_pretrained(os.path.join(args.workdir, "export"))
        tokenizer.save_pretrained(os.path.join(args.workdir, "export"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
