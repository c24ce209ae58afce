"""Document classification on RVL-CDIP (16 classes) with LayoutLM (text + 2D layout).

OCR (words + boxes) was extracted offline with Tesseract into one jsonl per split:
    {"words": [...], "boxes": [[x0, y0, x1, y1], ...], "width": W, "height": H, "label": 3}

Typical run (long jobs get preempted, so we resume from last.pt):
    torchrun --nproc_per_node=8 08_layoutlm_rvlcdip_cls.py --data-dir /data/rvl_ocr \
        --out-dir ckpt/layoutlm_rvl --resume ckpt/layoutlm_rvl/last.pt
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMForSequenceClassification, LayoutLMTokenizerFast, get_linear_schedule_with_warmup

RVL_LABELS = ["letter", "form", "email", "handwritten", "advertisement", "scientific report",
              "scientific publication", "specification", "file folder", "news article", "budget",
              "invoice", "presentation", "questionnaire", "resume", "memo"]

log = logging.getLogger(__name__)


def normalize_box(box, w, h):
    return [max(0, min(1000, int(1000 * box[0] / w))), max(0, min(1000, int(1000 * box[1] / h))),
            max(0, min(1000, int(1000 * box[2] / w))), max(0, min(1000, int(1000 * box[3] / h)))]


class RvlOcrDataset(Dataset):
    def __init__(self, path, tokenizer, max_len=512):
        self.offsets = []
        self.path = path
        with open(path, "rb") as f:
            pos = f.tell()
            line = f.readline()
            while line:
                self.offsets.append(pos)
                pos = f.tell()
                line = f.readline()
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i])
            doc = json.loads(f.readline())
        words = doc["words"] or ["[EMPTY]"]
        boxes = [normalize_box(b, doc["width"], doc["height"]) for b in doc["boxes"]] or [[0, 0, 0, 0]]
        enc = self.tok(words, is_split_into_words=True, truncation=True, max_length=self.max_len,
                       padding="max_length", return_tensors="pt")
        word_ids = enc.word_ids(0)
        bbox = [[0, 0, 0, 0] if wid is None else boxes[wid] for wid in word_ids]
        # [SEP] gets the full-page box as in the LayoutLM paper
        sep_pos = enc.input_ids[0].tolist().index(self.tok.sep_token_id)
        bbox[sep_pos] = [1000, 1000, 1000, 1000]
        return {"input_ids": enc.input_ids[0], "attention_mask": enc.attention_mask[0],
                "token_type_ids": enc.token_type_ids[0], "bbox": torch.tensor(bbox), "labels": doc["label"]}


def collate(batch):
    out = {k: torch.stack([b[k] for b in batch]) for k in ("input_ids", "attention_mask", "token_type_ids", "bbox")}
    out["labels"] = torch.tensor([b["labels"] for b in batch])
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    per_class = torch.zeros(len(RVL_LABELS), 2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        pred = logits.argmax(-1)
        hit = (pred == batch["labels"]).float()
        correct += hit.sum()
        seen += hit.numel()
        per_class[:, 0].index_add_(0, batch["labels"], hit)
        per_class[:, 1].index_add_(0, batch["labels"], torch.ones_like(hit))
    for t in (correct, seen, per_class):
        dist.all_reduce(t)
    model.train()
    return (correct / seen).item(), (per_class[:, 0] / per_class[:, 1].clamp(min=1)).tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--model", default="microsoft/layoutlm-base-uncased")
    p.add_argument("--out-dir", default="ckpt/layoutlm_rvl")
    p.add_argument("--resume", default="")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--save-every", type=int, default=2000)
    args = p.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    tok = LayoutLMTokenizerFast.from_pretrained(args.model)
    train_ds = RvlOcrDataset(os.path.join(args.data_dir, "train.jsonl"), tok)
    val_ds = RvlOcrDataset(os.path.join(args.data_dir, "val.jsonl"), tok)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                        collate_fn=collate, num_workers=8)

    model = LayoutLMForSequenceClassification.from_pretrained(args.model, num_labels=len(RVL_LABELS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(optim, int(args.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, start_step, best_acc = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_step, best_acc = ckpt["epoch"], ckpt["step"], ckpt["best_acc"]
        log.info("resumed from %s at epoch %d step %d", args.resume, start_epoch, start_step)

    def save(path, epoch, step):
        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "best_acc": best_acc}, path)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    model.train()
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            if epoch == start_epoch and step < start_step:
                continue  # fast-forward inside the interrupted epoch (same order thanks to set_epoch)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optim)
            scaler.update()
            sched.step()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_dl), loss.item(),
                         sched.get_last_lr()[0])
            if rank == 0 and (step + 1) % args.save_every == 0:
                save(os.path.join(args.out_dir, "last.pt"), epoch, step + 1)

        acc, per_class = evaluate(model, val_dl, device)
        log.info("epoch %d val acc %.4f (%.0fs)", epoch, acc, time.time() - t0)
        for name, a in zip(RVL_LABELS, per_class):
            log.info("    %-24s %.4f", name, a)
        if rank == 0:
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                tok.save_pretrained(os.path.join(args.out_dir, "best"))
            save(os.path.join(args.out_dir, "last.pt"), epoch + 1, 0)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
