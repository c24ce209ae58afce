"""LiLT (language-independent layout transformer) semantic entity recognition on XFUND.

Tokenising XFUND with the InfoXLM tokenizer takes a while, so the encoded features are cached to disk.

    torchrun --nproc_per_node=4 11_lilt_xfund_ser.py --xfund-dir /data/XFUND --langs zh ja es fr it de pt
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LiltForTokenClassification, get_polynomial_decay_schedule_with_warmup

ENTITY_TYPES = ["HEADER", "QUESTION", "ANSWER"]
LABELS = ["O"] + [f"{p}-{t}" for t in ENTITY_TYPES for p in ("B", "I")]
LABEL2ID = {l: i for i, l in enumerate(LABELS)}


def norm_box(b, w, h):
    return [int(1000 * b[0] / w), int(1000 * b[1] / h), int(1000 * b[2] / w), int(1000 * b[3] / h)]


def encode_documents(json_path, tokenizer, max_len):
    with open(json_path, encoding="utf-8") as f:
        docs = json.load(f)["documents"]
    features = []
    for doc in docs:
        W, H = doc["img"]["width"], doc["img"]["height"]
        input_ids, bboxes, labels = [], [], []
        for seg in doc["document"]:
            tag = seg["label"].upper()
            box = norm_box(seg["box"], W, H)
            ids = tokenizer(seg["text"], add_special_tokens=False).input_ids
            if not ids:
                continue
            input_ids += ids
            bboxes += [box] * len(ids)  # LiLT uses segment-level boxes
            if tag == "OTHER":
                labels += [LABEL2ID["O"]] * len(ids)
            else:
                labels += [LABEL2ID[f"B-{tag}"]] + [LABEL2ID[f"I-{tag}"]] * (len(ids) - 1)
        # split long documents into windows of max_len - 2
        step = max_len - 2
        for s in range(0, max(len(input_ids), 1), step):
            ids = [tokenizer.cls_token_id] + input_ids[s:s + step] + [tokenizer.sep_token_id]
            bb = [[0, 0, 0, 0]] + bboxes[s:s + step] + [[1000, 1000, 1000, 1000]]
            lab = [-100] + labels[s:s + step] + [-100]
            pad = max_len - len(ids)
            features.append({
                "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "bbox": torch.tensor(bb + [[0, 0, 0, 0]] * pad),
                "labels": torch.tensor(lab + [-100] * pad),
            })
    return features


def load_or_build(xfund_dir, lang, split, tokenizer, max_len, cache_dir):
    cache = os.path.join(cache_dir, f"xfund_{lang}_{split}_{max_len}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    feats = encode_documents(os.path.join(xfund_dir, f"{lang}.{split}.json"), tokenizer, max_len)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(feats, cache)
    return feats


class FeatureDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i]


def to_tags(ids_row, labels_row):
    keep = labels_row != -100
    return [LABELS[int(i)] for i in ids_row[keep]], [LABELS[int(l)] for l in labels_row[keep]]


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], bbox=batch["bbox"], attention_mask=batch["attention_mask"]).logits
        pred = logits.argmax(-1).cpu()
        for p, l in zip(pred, batch["labels"].cpu()):
            pt, lt = to_tags(p, l)
            y_pred.append(pt)
            y_true.append(lt)
    out = [None] * world
    dist.all_gather_object(out, (y_true, y_pred))
    y_true = [s for t, _ in out for s in t]
    y_pred = [s for _, p in out for s in p]
    model.train()
    return precision_score(y_true, y_pred), recall_score(y_true, y_pred), f1_score(y_true, y_pred)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xfund-dir", required=True)
    ap.add_argument("--langs", nargs="+", default=["zh"])
    ap.add_argument("--model", default="SCUT-DLVCLab/lilt-infoxlm-base")
    ap.add_argument("--cache-dir", default="cache/xfund")
    ap.add_argument("--out-dir", default="runs/lilt_xfund")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--eval-every", type=int, default=1000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_feats, val_feats = [], []
    for lang in args.langs:
        train_feats += load_or_build(args.xfund_dir, lang, "train", tokenizer, args.max_len, args.cache_dir)
        val_feats += load_or_build(args.xfund_dir, lang, "val", tokenizer, args.max_len, args.cache_dir)
    if rank == 0:
        print(f"{len(train_feats)} train windows, {len(val_feats)} val windows ({', '.join(args.langs)})", flush=True)

    train_ds = FeatureDataset(train_feats)
    val_ds = Subset(FeatureDataset(val_feats), range(rank, len(val_feats), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=16, num_workers=2)

    model = LiltForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=LABEL2ID).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, int(0.1 * args.steps), args.steps)

    step, epoch, best_f1 = 0, 0, -1.0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step} epoch {epoch} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                p, r, f1 = evaluate(model, val_dl, device, world)
                if rank == 0:
                    print(f"[eval] step {step} P {p:.4f} R {r:.4f} F1 {f1:.4f}", flush=True)
                    if f1 > best_f1:
                        best_f1 = f1
                        model.module.save_pretrained(args.out_dir)
                        tokenizer.save_pretrained(args.out_dir)
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
