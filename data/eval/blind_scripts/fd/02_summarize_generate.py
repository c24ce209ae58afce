"""Distributed batched summarization + ROUGE.

    torchrun --nproc_per_node 8 02_summarize_generate.py --model google/flan-t5-xl

Every rank generates summaries for its DistributedSampler shard; the token ids
are gathered to rank 0, decoded and scored.
"""
import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import evaluate
from datasets import load_dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/flan-t5-large")
    ap.add_argument("--dataset", default="cnn_dailymail")
    ap.add_argument("--dataset_config", default="3.0.0")
    ap.add_argument("--split", default="test")
    ap.add_argument("--prefix", default="summarize: ")
    ap.add_argument("--max_source_len", type=int, default=1024)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--num_beams", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--max_samples", type=int, default=None)
    ap.add_argument("--out", default="outputs/summaries")
    return ap.parse_args()


class ArticleDataset(Dataset):
    def __init__(self, hf_ds, tokenizer, prefix, max_len):
        self.ds = hf_ds
        self.tok = tokenizer
        self.prefix = prefix
        self.max_len = max_len

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        ex = self.ds[i]
        enc = self.tok(self.prefix + ex["article"], max_length=self.max_len, truncation=True)
        return {"idx": i, "input_ids": enc["input_ids"]}


def collate(batch, pad_id):
    max_len = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        mask[i, :n] = 1
    idx = torch.tensor([b["idx"] for b in batch], dtype=torch.long)
    return {"idx": idx, "input_ids": ids, "attention_mask": mask}


def init_dist():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def main():
    args = get_args()
    rank, world_size, local_rank = init_dist()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.to(device).eval()

    raw = load_dataset(args.dataset, args.dataset_config, split=args.split)
    if args.max_samples:
        raw = raw.select(range(min(args.max_samples, len(raw))))
    references = raw["highlights"]

    ds = ArticleDataset(raw, tokenizer, args.prefix, args.max_source_len)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        collate_fn=partial(collate, pad_id=tokenizer.pad_token_id),
        pin_memory=True,
    )

    all_ids, all_out = [], []
    t0 = time.time()
    with torch.inference_mode():
        for step, batch in enumerate(loader):
            out = model.generate(
                input_ids=batch["input_ids"].to(device, non_blocking=True),
                attention_mask=batch["attention_mask"].to(device, non_blocking=True),
                max_new_tokens=args.max_new_tokens,
                num_beams=args.num_beams,
                early_stopping=True,
            )
            all_out.append(out)
            all_ids.append(batch["idx"].to(device))
            if is_main and step % 20 == 0:
                print(f"[{time.time() - t0:7.1f}s] step {step}/{len(loader)}", flush=True)

    # pad every batch to a common width before concatenating
    width = max(o.size(1) for o in all_out)
    local_out = torch.cat(
        [F.pad(o, (0, width - o.size(1)), value=tokenizer.pad_token_id) for o in all_out]
    )
    local_ids = torch.cat(all_ids)

    gathered_ids = [torch.empty_like(local_ids) for _ in range(world_size)]
    gathered_out = [torch.empty_like(local_out) for _ in range(world_size)]
    dist.all_gather(gathered_ids, local_ids)
    dist.all_gather(gathered_out, local_out)

    if is_main:
        preds = {}
        for ids, out in zip(gathered_ids, gathered_out):
            texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            for i, t in zip(ids.tolist(), texts):
                preds.setdefault(i, t.strip())  # DistributedSampler repeats a few samples
        order = sorted(preds)
        predictions = [preds[i] for i in order]
        refs = [references[i] for i in order]

        rouge = evaluate.load("rouge")
        scores = rouge.compute(predictions=predictions, references=refs, use_stemmer=True)
        scores = {k: round(float(v) * 100, 2) for k, v in scores.items()}
        print(json.dumps(scores, indent=2))

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predictions.jsonl"), "w") as f:
            for i, p in zip(order, predictions):
                f.write(json.dumps({"idx": i, "prediction": p}) + "\n")
        with open(os.path.join(args.out, "rouge.json"), "w") as f:
            json.dump({"model": args.model, "n": len(order), **scores}, f, indent=2)
        print(f"done in {time.time() - t0:.1f}s, {len(order)} samples")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
