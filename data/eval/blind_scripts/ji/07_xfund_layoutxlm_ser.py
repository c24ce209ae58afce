"""LayoutXLM semantic entity recognition on XFUND (zh/ja/es/fr/it/de/pt).

Encoding the forms (tokenization, box alignment, image resize) takes a while, so the
encoded features are cached under --cache_dir and re-used by later runs.

    torchrun --nproc_per_node=4 07_xfund_layoutxlm_ser.py --data_dir /data/XFUND --lang zh
"""
import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from PIL import Image
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import LayoutLMv2ForTokenClassification, LayoutXLMProcessor, get_polynomial_decay_schedule_with_warmup

LABELS = ["O", "B-HEADER", "I-HEADER", "B-QUESTION", "I-QUESTION", "B-ANSWER", "I-ANSWER"]
L2I = {l: i for i, l in enumerate(LABELS)}
logger = logging.getLogger("xfund")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--lang", default="zh")
    p.add_argument("--model", default="microsoft/layoutxlm-base")
    p.add_argument("--cache_dir", default="cache/xfund")
    p.add_argument("--output_dir", default="outputs/xfund_ser")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--eval_steps", type=int, default=200)
    return p.parse_args()


def norm_box(box, w, h):
    x0, y0, x1, y1 = box
    return [int(1000 * x0 / w), int(1000 * y0 / h), int(1000 * x1 / w), int(1000 * y1 / h)]


def read_xfund(json_path, img_dir):
    with open(json_path, encoding="utf-8") as f:
        docs = json.load(f)["documents"]
    for doc in docs:
        w, h = doc["img"]["width"], doc["img"]["height"]
        words, boxes, tags = [], [], []
        for ent in doc["document"]:
            lab = ent["label"].upper()
            ent_words = [wd for wd in ent["words"] if wd["text"].strip()]
            for j, wd in enumerate(ent_words):
                words.append(wd["text"])
                boxes.append(norm_box(wd["box"], w, h))
                if lab == "OTHER":
                    tags.append("O")
                else:
                    tags.append(("B-" if j == 0 else "I-") + lab)
        yield os.path.join(img_dir, doc["img"]["fname"]), words, boxes, tags


def encode_split(processor, data_dir, lang, split, max_len):
    json_path = os.path.join(data_dir, f"{lang}.{split}.json")
    img_dir = os.path.join(data_dir, f"{lang}.{split}")
    feats = []
    for img_path, words, boxes, tags in tqdm(list(read_xfund(json_path, img_dir)), desc=f"encode {split}"):
        image = Image.open(img_path).convert("RGB")
        enc = processor(image, words, boxes=boxes, word_labels=[L2I[t] for t in tags],
                        truncation=True, padding="max_length", max_length=max_len,
                        return_overflowing_tokens=True, return_tensors="pt")
        # the processor already repeats the page image for every overflowing window
        for k in range(enc["input_ids"].size(0)):
            feats.append({
                "input_ids": enc["input_ids"][k],
                "bbox": enc["bbox"][k],
                "attention_mask": enc["attention_mask"][k],
                "labels": enc["labels"][k],
                "image": torch.as_tensor(enc["image"][k]),
            })
    return feats


def load_or_build(args, processor, split):
    os.makedirs(args.cache_dir, exist_ok=True)
    path = os.path.join(args.cache_dir, f"{args.lang}_{split}_{args.max_len}.pt")
    if os.path.exists(path):
        return torch.load(path)
    feats = encode_split(processor, args.data_dir, args.lang, split, args.max_len)
    torch.save(feats, path)
    return feats


class FeatureDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        f = self.feats[i]
        return {k: torch.as_tensor(v) for k, v in f.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    local_true, local_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        logits = logits[:, : batch["labels"].size(1)]  # drop the visual tokens
        preds = logits.argmax(-1).cpu().tolist()
        for p_row, l_row in zip(preds, batch["labels"].cpu().tolist()):
            local_true.append([LABELS[l] for l in l_row if l != -100])
            local_pred.append([LABELS[p] for p, l in zip(p_row, l_row) if l != -100])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local_true, local_pred))
    model.train()
    y_true = [s for t, _ in gathered for s in t]
    y_pred = [s for _, p in gathered for s in p]
    return {"precision": precision_score(y_true, y_pred), "recall": recall_score(y_true, y_pred),
            "f1": f1_score(y_true, y_pred)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)

    processor = LayoutXLMProcessor.from_pretrained(args.model, apply_ocr=False)
    train_ds = FeatureDataset(load_or_build(args, processor, "train"))
    val_ds = FeatureDataset(load_or_build(args, processor, "val"))

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4, drop_last=True)
    # non-padded slices so that no form is counted twice in the entity F1
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), dist.get_world_size())),
                        batch_size=args.bs, num_workers=2)

    model = LayoutLMv2ForTokenClassification.from_pretrained(args.model, num_labels=len(LABELS))
    model.to(device)
    # the token classifier only reads the p2 level of the visual FPN and never the pooler
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, int(args.warmup * args.steps), args.steps)

    step, epoch, best_f1 = 0, 0, 0.0
    model.train()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                logger.info("step %d loss %.4f", step, loss.item())
            if step % args.eval_steps == 0 or step == args.steps:
                m = evaluate(model.module, val_dl, device)
                logger.info("step %d  P %.4f  R %.4f  F1 %.4f", step, m["precision"], m["recall"], m["f1"])
                if rank == 0 and m["f1"] > best_f1:
                    best_f1 = m["f1"]
                    model.module.save_pretrained(args.output_dir)
                    processor.save_pretrained(args.output_dir)
            if step >= args.steps:
                break
        epoch += 1

    logger.info("best F1 %.4f", best_f1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
