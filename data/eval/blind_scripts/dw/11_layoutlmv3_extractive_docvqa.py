"""Extractive DocVQA with LayoutLMv3ForQuestionAnswering.

Pages are OCR'd with Tesseract through the LayoutLMv3 image processor (apply_ocr=True);
OCR is slow (~1.5 s/page) so the encoded features are cached next to the data.

    torchrun --nproc_per_node=8 11_layoutlmv3_extractive_docvqa.py \
        --data_dir /shared/docvqa --cache_dir /shared/docvqa/features --output_dir /shared/runs/lmv3_qa
"""
import argparse
import json
import logging
import os

import Levenshtein
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoProcessor, LayoutLMv3ForQuestionAnswering, get_linear_schedule_with_warmup

logger = logging.getLogger("docvqa")


def args_from_cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="microsoft/layoutlmv3-base")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--ocr_lang", default="eng")
    return p.parse_args()


def find_answer_span(words, answer):
    """Word-level (start, end) of the first exact match of the answer in the OCR words."""
    ans = answer.lower().split()
    low = [w.lower() for w in words]
    for i in range(len(low) - len(ans) + 1):
        if low[i : i + len(ans)] == ans:
            return i, i + len(ans) - 1
    return None


def encode_split(records, image_dir, processor, max_length, desc):
    features = []
    for r in tqdm(records, desc=desc, mininterval=30):
        image = Image.open(os.path.join(image_dir, r["image"])).convert("RGB")
        enc = processor(image, r["question"], truncation="only_second", max_length=max_length,
                        padding="max_length", return_tensors="pt")
        words = processor.image_processor(image).words[0]
        word_ids = enc.word_ids(0)
        seq_ids = enc.sequence_ids(0)
        start = end = 0  # CLS when the answer is not found in the OCR
        span = find_answer_span(words, r["answers"][0]) if r.get("answers") else None
        if span is not None:
            tok_pos = [i for i, (w, s) in enumerate(zip(word_ids, seq_ids)) if s == 1 and w is not None]
            starts = [i for i in tok_pos if word_ids[i] == span[0]]
            ends = [i for i in tok_pos if word_ids[i] == span[1]]
            if starts and ends:
                start, end = starts[0], ends[-1]
        features.append({
            "input_ids": enc.input_ids[0], "attention_mask": enc.attention_mask[0], "bbox": enc.bbox[0],
            "pixel_values": enc.pixel_values[0].half(), "start_positions": torch.tensor(start),
            "end_positions": torch.tensor(end), "qid": r["questionId"],
        })
    return features


def load_or_build_features(split, args, processor):
    cache_file = os.path.join(args.cache_dir, f"{split}_lmv3_{args.max_length}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    with open(os.path.join(args.data_dir, f"{split}_v1.0.json")) as fh:
        records = json.load(fh)["data"]
    feats = encode_split(records, os.path.join(args.data_dir, "images"), processor, args.max_length, split)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(feats, cache_file)
    return feats


class FeatureDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        f = dict(self.feats[i])
        f["pixel_values"] = f["pixel_values"].float()
        return f


def anls(pred, golds, tau=0.5):
    best = 0.0
    for g in golds:
        d = Levenshtein.distance(pred.lower().strip(), g.lower().strip()) / max(len(pred), len(g), 1)
        best = max(best, 0.0 if d >= tau else 1.0 - d)
    return best


@torch.no_grad()
def evaluate(model, loader, tokenizer, gold_answers, device):
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        qids = batch.pop("qid")
        batch = {k: v.to(device) for k, v in batch.items() if k not in ("start_positions", "end_positions")}
        out = model(**batch)
        s = out.start_logits.argmax(-1)
        e = out.end_logits.argmax(-1)
        for i, qid in enumerate(qids.tolist()):
            a, b = s[i].item(), e[i].item()
            pred = tokenizer.decode(batch["input_ids"][i, a : b + 1]) if b >= a else ""
            total[0] += anls(pred, gold_answers[qid])
            total[1] += 1
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = args_from_cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = AutoProcessor.from_pretrained(args.model, apply_ocr=True, ocr_lang=args.ocr_lang)
    train_feats = load_or_build_features("train", args, processor)
    val_feats = load_or_build_features("val", args, processor)
    with open(os.path.join(args.data_dir, "val_v1.0.json")) as fh:
        gold = {r["questionId"]: r["answers"] for r in json.load(fh)["data"]}

    train_ds, val_ds = FeatureDataset(train_feats), FeatureDataset(val_feats)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32, num_workers=2)

    model = LayoutLMv3ForQuestionAnswering.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch.pop("qid")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        score = evaluate(model.module, val_dl, processor.tokenizer, gold, device)
        if rank == 0:
            logger.info("epoch %d val ANLS %.4f", epoch, score)
            if score > best:
                best = score
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
