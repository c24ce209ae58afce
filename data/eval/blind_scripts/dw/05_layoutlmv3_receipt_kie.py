"""
Key-information extraction on receipts (SROIE-style fields + tax lines) with LayoutLMv3.

Annotation export format (one JSON per page, produced by the labelling tool):
    {"image": "imgs/000123.jpg", "width": 1240, "height": 1754,
     "words": [...], "boxes": [[x0, y0, x1, y1], ...], "tags": ["B-COMPANY", "O", ...]}

Launch (single node, 8 GPUs):
    torchrun --nproc_per_node 8 05_layoutlmv3_receipt_kie.py --data_root /nfs/kie/receipts_v4 \
        --output_dir /nfs/kie/runs/lmv3_receipts
"""
import argparse
import glob
import json
import logging
import os

import torch
import torch.distributed as dist
from PIL import Image
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.scheme import IOB2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3ForTokenClassification, LayoutLMv3Processor, get_linear_schedule_with_warmup

logger = logging.getLogger("kie")

FIELDS = ["COMPANY", "ADDRESS", "DATE", "TOTAL", "TAX", "SUBTOTAL"]
LABELS = ["O"] + [f"{p}-{f}" for f in FIELDS for p in ("B", "I")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}
ID2LABEL = {i: l for l, i in LABEL2ID.items()}


def normalize_box(box, width, height):
    x0, y0, x1, y1 = box
    return [
        max(0, min(1000, int(1000 * x0 / width))),
        max(0, min(1000, int(1000 * y0 / height))),
        max(0, min(1000, int(1000 * x1 / width))),
        max(0, min(1000, int(1000 * y1 / height))),
    ]


class ReceiptPages(Dataset):
    def __init__(self, split_dir, processor, max_length=512):
        self.files = sorted(glob.glob(os.path.join(split_dir, "*.json")))
        self.root = os.path.dirname(split_dir.rstrip("/"))
        self.processor = processor
        self.max_length = max_length

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        with open(self.files[idx], encoding="utf-8") as fh:
            page = json.load(fh)
        image = Image.open(os.path.join(self.root, page["image"])).convert("RGB")
        boxes = [normalize_box(b, page["width"], page["height"]) for b in page["boxes"]]
        word_labels = [LABEL2ID.get(t, 0) for t in page["tags"]]
        enc = self.processor(
            image, page["words"], boxes=boxes, word_labels=word_labels,
            truncation=True, padding="max_length", max_length=self.max_length, return_tensors="pt",
        )
        return {k: v.squeeze(0) for k, v in enc.items()}


def to_tag_sequences(pred_ids, label_ids):
    y_true, y_pred = [], []
    for p_row, l_row in zip(pred_ids.tolist(), label_ids.tolist()):
        t, p = [], []
        for pi, li in zip(p_row, l_row):
            if li == -100:
                continue
            t.append(ID2LABEL[li])
            p.append(ID2LABEL[pi])
        y_true.append(t)
        y_pred.append(p)
    return y_true, y_pred


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    loss_sum, n_batches = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        loss_sum += out.loss.item()
        n_batches += 1
        t, p = to_tag_sequences(out.logits.argmax(-1).cpu(), batch["labels"].cpu())
        y_true += t
        y_pred += p
    model.train()
    return {
        "loss": loss_sum / max(n_batches, 1),
        "precision": precision_score(y_true, y_pred, mode="strict", scheme=IOB2),
        "recall": recall_score(y_true, y_pred, mode="strict", scheme=IOB2),
        "f1": f1_score(y_true, y_pred, mode="strict", scheme=IOB2),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model", default="microsoft/layoutlmv3-base")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--patience", type=int, default=5)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)
    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=ID2LABEL, label2id=LABEL2ID
    )
    model = DDP(model.to(device), device_ids=[local_rank])

    train_ds = ReceiptPages(os.path.join(args.data_root, "train"), processor)
    val_ds = ReceiptPages(os.path.join(args.data_root, "val"), processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8, sampler=val_sampler, num_workers=4, pin_memory=True)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(optim, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("train pages=%d val pages=%d", len(train_ds), len(val_ds))

    best_f1, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        metrics = evaluate(model.module, val_loader, device)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            logger.info("epoch %d val loss %.4f P %.4f R %.4f F1 %.4f", epoch, metrics["loss"],
                        metrics["precision"], metrics["recall"], metrics["f1"])
            if metrics["f1"] > best_f1:
                best_f1, bad_epochs = metrics["f1"], 0
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    logger.info("early stopping, best F1 %.4f", best_f1)
                    stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
