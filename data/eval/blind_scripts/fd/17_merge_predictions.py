"""Score a large web-text dump with an educational-quality classifier.

    torchrun --nproc_per_node=8 17_merge_predictions.py \
        --model HuggingFaceFW/fineweb-edu-classifier --data_files "dump/*.parquet" \
        --out_dir scored/cc-2024-10 --threshold 3

Each rank scores one contiguous shard of the dataset and streams its results to
its own jsonl file; rank 0 merges the parts, writes the filtered id list and a
histogram of scores.
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceFW/fineweb-edu-classifier")
    ap.add_argument("--data_files", required=True)
    ap.add_argument("--text_column", default="text")
    ap.add_argument("--id_column", default="id")
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=3.0)
    ap.add_argument("--num_workers", type=int, default=4)
    return ap.parse_args()


class Collate:
    def __init__(self, tok, max_len, text_col, id_col):
        self.tok, self.max_len = tok, max_len
        self.text_col, self.id_col = text_col, id_col

    def __call__(self, rows):
        enc = self.tok([r[self.text_col] for r in rows], padding="longest", truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return [r[self.id_col] for r in rows], enc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out_dir, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.to(device).eval()

    ds = load_dataset("parquet", data_files=args.data_files, split="train")
    ds = ds.select_columns([args.id_column, args.text_column])
    shard = ds.shard(num_shards=world, index=rank, contiguous=True)
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=False,
                        num_workers=args.num_workers,
                        collate_fn=Collate(tok, args.max_len, args.text_column, args.id_column))
    if rank == 0:
        print(f"{len(ds):,} docs total, {len(shard):,} on rank 0", flush=True)

    part_path = os.path.join(args.out_dir, f"part-{rank:05d}.jsonl")
    t0 = time.time()
    n = 0
    with open(part_path, "w") as fout, torch.inference_mode():
        for step, (ids, enc) in enumerate(loader):
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            logits = model(**enc).logits.squeeze(-1).float()
            scores = logits.cpu().tolist()
            for doc_id, sc in zip(ids, scores):
                fout.write(json.dumps({"id": doc_id, "score": round(sc, 4),
                                       "int_score": int(round(max(0.0, min(sc, 5.0))))}) + "\n")
            n += len(ids)
            if rank == 0 and step % 50 == 0:
                rate = n / max(time.time() - t0, 1e-6)
                print(f"  step {step}/{len(loader)}  {rate:,.0f} docs/s on rank 0", flush=True)

    if rank == 0:
        all_scores, keep_ids, n_parts = [], [], 0
        for path in sorted(glob.glob(os.path.join(args.out_dir, "part-*.jsonl"))):
            n_parts += 1
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    all_scores.append(rec["score"])
                    if rec["score"] >= args.threshold:
                        keep_ids.append(rec["id"])
        all_scores = np.asarray(all_scores)
        hist, edges = np.histogram(all_scores, bins=[-np.inf, 0.5, 1.5, 2.5, 3.5, 4.5, np.inf])
        summary = {
            "model": args.model,
            "parts": n_parts,
            "docs": int(all_scores.size),
            "expected_docs": len(ds),
            "kept": len(keep_ids),
            "keep_rate": len(keep_ids) / max(all_scores.size, 1),
            "mean_score": float(all_scores.mean()) if all_scores.size else None,
            "int_score_hist": {str(i): int(h) for i, h in enumerate(hist)},
            "seconds": round(time.time() - t0, 1),
        }
        with open(os.path.join(args.out_dir, "kept_ids.txt"), "w") as f:
            f.write("\n".join(map(str, keep_ids)) + "\n")
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
