"""Multilingual form understanding (XFUND semantic entity recognition) with LayoutXLM.

Trains on all 7 XFUND languages jointly. Jobs on the shared queue get preempted, so the
script checkpoints every epoch and picks up from the last one with --resume.

    torchrun --nproc_per_node=8 16_layoutxlm_xfund_resume.py --xfund_dir /data/xfund --resume
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv2ForTokenClassification, LayoutXLMProcessor, get_polynomial_decay_schedule_with_warmup

LANGS = ["zh", "ja", "es", "fr", "it", "de", "pt"]
LABELS = ["O", "B-HEADER", "I-HEADER", "B-QUESTION", "I-QUESTION", "B-ANSWER", "I-ANSWER"]
L2I = {l: i for i, l in enumerate(LABELS)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xfund_dir", required=True)
    ap.add_argument("--model", default="microsoft/layoutxlm-base")
    ap.add_argument("--ckpt_dir", default="checkpoints/layoutxlm_xfund")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def norm_box(b, w, h):
    return [int(1000 * b[0] / w), int(1000 * b[1] / h), int(1000 * b[2] / w), int(1000 * b[3] / h)]


class XFUND(Dataset):
    def __init__(self, root, lang, split, processor):
        with open(os.path.join(root, f"{lang}.{split}.json"), encoding="utf-8") as f:
            docs = json.load(f)["documents"]
        self.root, self.lang, self.split, self.processor = root, lang, split, processor
        self.samples = []
        for doc in docs:
            w, h = doc["img"]["width"], doc["img"]["height"]
            words, boxes, labels = [], [], []
            for ent in doc["document"]:
                tag = ent["label"].upper()
                for k, wd in enumerate(ent["words"]):
                    if not wd["text"].strip():
                        continue
                    words.append(wd["text"])
                    boxes.append(norm_box(wd["box"], w, h))
                    if tag == "OTHER":
                        labels.append(L2I["O"])
                    else:
                        labels.append(L2I[("B-" if k == 0 else "I-") + tag])
            self.samples.append((doc["img"]["fname"], words, boxes, labels))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fname, words, boxes, labels = self.samples[i]
        image = Image.open(os.path.join(self.root, f"{self.lang}.{self.split}", fname)).convert("RGB")
        enc = self.processor(image, words, boxes=boxes, word_labels=labels, truncation=True,
                             padding="max_length", max_length=512, return_tensors="pt")
        return {k: v[0] for k, v in enc.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        pred = model(**batch).logits.argmax(-1)
        for p, l in zip(pred.tolist(), batch["labels"].tolist()):
            y_true.append([LABELS[b] for a, b in zip(p, l) if b != -100])
            y_pred.append([LABELS[a] for a, b in zip(p, l) if b != -100])
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (y_true, y_pred))
    model.train()
    return f1_score([s for t, _ in parts for s in t], [s for _, p in parts for s in p])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    processor = LayoutXLMProcessor.from_pretrained(args.model, apply_ocr=False)
    train_ds = ConcatDataset([XFUND(args.xfund_dir, lang, "train", processor) for lang in LANGS])
    val_ds = ConcatDataset([XFUND(args.xfund_dir, lang, "val", processor) for lang in LANGS])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    model = LayoutLMv2ForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=L2I
    )
    model.to(device)
    # the visual backbone (detectron2 ResNeXt-FPN) has BatchNorm; share statistics across the GPUs
    model.layoutlmv2.visual.synchronize_batch_norm()
    # only the p2 level of the visual FPN feeds the encoder, the other output convs get no gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    start_epoch, best_f1 = 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.isfile(last_path):
        state = torch.load(last_path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_f1 = state["epoch"] + 1, state["best_f1"]
        del state
        if rank == 0:
            print(f"resuming at epoch {start_epoch} (best F1 so far {best_f1:.4f})", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        f1 = evaluate(model, val_loader, device)
        if rank == 0:
            best_f1 = max(best_f1, f1)
            print(f"epoch {epoch}: val F1 {f1:.4f} best {best_f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": best_f1}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if f1 >= best_f1:
                model.module.save_pretrained(os.path.join(args.ckpt_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
