"""Receipt key-information extraction on CORD with LayoutLMv3 (token classification, 30 fields).

    torchrun --nproc_per_node=4 20_layoutlmv3_cord_ner.py --out runs/lmv3_cord
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3ForTokenClassification, LayoutLMv3Processor, get_linear_schedule_with_warmup


class CordFeatures(Dataset):
    """Encodes one receipt per item: image + words + (0-1000) boxes + word-level BIO labels."""

    def __init__(self, hf_split, processor, max_len=512):
        self.ds, self.processor, self.max_len = hf_split, processor, max_len

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        ex = self.ds[i]
        enc = self.processor(ex["image"].convert("RGB"), ex["words"], boxes=ex["bboxes"],
                             word_labels=ex["ner_tags"], truncation=True, padding="max_length",
                             max_length=self.max_len, return_tensors="pt")
        return {k: v.squeeze(0) for k, v in enc.items()}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model, loader, id2label, device):
    model.eval()
    y_true, y_pred = [], []
    loss_sum, n = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        loss_sum += out.loss.item() * batch["labels"].shape[0]
        n += batch["labels"].shape[0]
        preds = out.logits.argmax(-1).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        for p, l in zip(preds, labels):
            m = l != -100
            y_true.append([id2label[x] for x in l[m]])
            y_pred.append([id2label[x] for x in p[m]])
    model.train()
    return {"loss": loss_sum / max(n, 1), "f1": f1_score(y_true, y_pred),
            "report": classification_report(y_true, y_pred, digits=3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="microsoft/layoutlmv3-base")
    ap.add_argument("--dataset", default="nielsr/cord-layoutlmv3")
    ap.add_argument("--out", default="runs/lmv3_cord")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    raw = load_dataset(args.dataset)
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))
    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)

    train_ds = CordFeatures(raw["train"], processor)
    val_ds = CordFeatures(raw["validation"], processor)
    test_ds = CordFeatures(raw["test"], processor)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=4, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=8, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=8, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=4)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model, id2label=id2label, label2id={v: k for k, v in id2label.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total), total)

    best_f1, best_epoch = -1.0, -1
    best_dir = os.path.join(args.out, "best")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        run = 0.0
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run += loss.item()
        res = evaluate(model, val_dl, id2label, device)
        if rank == 0:
            print(f"epoch {epoch} train_loss {run / len(train_dl):.4f} val_loss {res['loss']:.4f} "
                  f"val_f1 {res['f1']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if res["f1"] > best_f1:
                best_f1, best_epoch = res["f1"], epoch
                model.module.save_pretrained(best_dir)
                processor.save_pretrained(best_dir)
        dist.barrier()

    # final test with the best checkpoint
    best = LayoutLMv3ForTokenClassification.from_pretrained(best_dir).to(device)
    best = DDP(best, device_ids=[local_rank])
    res = evaluate(best, test_dl, id2label, device)
    if rank == 0:
        print(f"best epoch {best_epoch} (val f1 {best_f1:.4f})\nTEST f1 {res['f1']:.4f}\n{res['report']}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
